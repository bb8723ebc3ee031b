"""What one engine step runs, as plain data: the scheduler writes it, the runner runs it, and the
scheduler reads the runner's output against it.

`Engine.step` is `plan = scheduler.schedule()` -> `out = runner.run(plan)` ->
`scheduler.postprocess(plan, out)`, the shape nano-vllm's `LLMEngine.step` has. A plan is one
forward pass. It holds positions, layer ranges and drafted token ids; the caches, inputs and
samplers it names are reached through the sequences it lists and the batch it refers to, which
the scheduler owns. It makes no array itself, so a planner is tested without a model (tests/test_planner.py), and a bench
times the three calls from outside (Engine.add_step_listener).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import mlx.core as mx

    from rewind.engine.sequence import Sequence

P = TypeVar("P")


@dataclass(frozen=True)
class PrefillSlice(Generic[P]):
    """One prefill call of one prompt: positions [start, end), through layers [first, stop)
    (stop None: to the last layer). `prompt` is a Sequence in the engine, anything with the
    planner's fields in tests."""

    prompt: P
    start: int
    end: int
    stop: int | None = None
    first: int = 0  # the layer it starts at (a call in flight goes on where it stopped)


@dataclass
class StepPlan:
    """One forward pass.

    - `decode`: the decode batch's rows, in batch order (empty: no decode this pass). With
      `pipelined`, they are fed the tokens of the step still in flight (read after this one is
      queued, as mlx-lm's batch generator does); else each row's `next_input`.
    - `drafts`: (row, drafted tokens) of the rows that verify a speculative draft this pass.
    - `prefill`: prompt calls beside them, each on its sequence's own cache.
    - `checkpoints`: the prefill calls after which the prompt cache takes a checkpoint.
    - `continuation`: a further prefill pass of the same step (rewind.engine.planner: the
      calls after one that passed every layer); no admission or decode runs before it.
    - `admitted`: the sequences this step admitted (their cached prefix restored), for the
      record: replay and benches read it.
    """

    decode: list[Sequence] = field(default_factory=list)
    batch: list[Any] | None = None  # the decode batch's caches (row i: decode[i])
    pipelined: bool = False
    fed: Any = None  # pipelined: the in-flight step's samples (LazySamples), on the device
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)
    prefill: list[PrefillSlice[Sequence]] = field(default_factory=list)
    checkpoints: list[PrefillSlice[Sequence]] = field(default_factory=list)
    continuation: bool = False
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def decode_rows(self) -> int:
        return len(self.decode)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.end - s.start for s in self.prefill)


@dataclass
class StepOutput:
    """What runner.run(plan) returns.

    - `decode_logits`: one entry per decode segment the runner built: with no drafts one
      [rows, vocab] (lazy when the plan is pipelined); with drafts each drafting row's
      [1, len(draft) + 1, vocab] in `drafts` order, then the other rows' together.
    - `prefill_logits`: per prefill slice, its last position's logits [1, vocab] where the
      slice ends its prompt and passed every layer, else None.
    - `carried`: per prefill slice, its rows in flight when it stopped before the last layer.
    - `failed`: prefill slices whose own inputs (a request's image features) failed, with the
      error; the sequence ends, the pass ran without it.
    - `decode_failed`: the decode rows' inputs failed (the pass ran without them).
    """

    decode_logits: list[mx.array | None] = field(default_factory=list)
    prefill_logits: list[mx.array | None] = field(default_factory=list)
    carried: list[Any] = field(default_factory=list)
    failed: dict[int, Exception] = field(default_factory=dict)
    decode_failed: Exception | None = None
