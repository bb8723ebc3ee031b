"""One request's life inside the engine: what the scheduler plans with and the runner reads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rewind.engine.request import FinishEvent, GenerationRequest, TokenEvent, Usage
from rewind.engine.sampler import SequenceSampler
from rewind.engine.speculation import RowDrafts
from rewind.engine.stops import TextStream

EventSink = Callable[[TokenEvent | FinishEvent], None]


@dataclass(eq=False)  # identity: the scheduler's queues find a sequence by `is`
class Sequence:
    """One request's life inside the engine."""

    request: GenerationRequest
    emit: EventSink
    sampler: SequenceSampler
    text: TextStream
    submitted_at: float
    usage: Usage
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set once it holds a slot and its cached prefix is restored (usage.cached_tokens is final),
    # or once it finished without: Anthropic's stream reports cache figures in its first event.
    admitted: threading.Event = field(default_factory=threading.Event)
    cache: list[Any] | None = None  # its own batch-1 cache while prefilling
    prefilled: int = 0  # prompt tokens held by `cache`
    # A chunk part-way through the layers (runner.layer_count): its end and its rows in flight.
    # `cache` then holds the chunk in the layers it passed; `prefilled` counts it once all did.
    partial_end: int = 0
    partial: Any = None
    checkpoint_at: set[int] = field(default_factory=set)  # extra checkpoint positions
    generated: list[int] = field(default_factory=list)
    next_input: int = -1  # last sampled token, the input of its next decode step
    last_token_at: float = 0.0
    drafts: RowDrafts | None = None  # its speculative-decoding state, while it may draft
    # Its cache's room in the memory budget (rewind.engine.memory_budget.Ticket), if one is
    # kept: taken for the prompt before admission, grown before each step that makes tokens.
    ticket: Any = None

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_tokens

    # ---- what the planner reads (rewind.engine.planner.PlannedPrompt) -----------------------

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def in_flight(self) -> tuple[int, int] | None:
        return None if self.partial is None else (self.partial_end, self.partial.done)

    @property
    def sliceable(self) -> bool:
        """Whether its calls can stop between layers: no per-call model state (rotary positions,
        per-layer residuals) to carry over."""
        return self.request.positions is None and self.request.layer_residuals is None

    @property
    def held(self) -> int:
        """Tokens its decode-batch row holds: the prompt and every generated token but the
        last, which is the next step's input."""
        return len(self.request.prompt_tokens) + len(self.generated) - 1
