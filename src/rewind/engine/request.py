"""What callers hand the engine (a request and its sampling knobs) and what they get back (events).

Everything here is plain data: the engine thread fills it in, callers read it.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from typing import Any, Literal


class EngineError(Exception):
    """Base of the engine's own errors."""


class QueueFullError(EngineError):
    """The admission queue is full; the caller should retry later (HTTP 429 + Retry-After)."""

    def __init__(self, queued: int, max_queue: int, retry_after_seconds: float = 1.0) -> None:
        super().__init__(f"the engine queue is full ({queued} waiting, limit {max_queue})")
        self.queued = queued
        self.max_queue = max_queue
        self.retry_after_seconds = retry_after_seconds


class EngineStoppedError(EngineError):
    """submit() after shutdown(), or before start()."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run as given (empty prompt, bad sampling values)."""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt + generated tokens; 1 -> off
    presence_penalty: float = 0.0  # OpenAI-style, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over generated tokens
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 256
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first value out of range."""
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (self.seed is None or 0 <= self.seed < 1 << 64, "seed must be in [0, 2**64)"),
            (all(math.isfinite(v) for v in (self.temperature, self.top_p, self.min_p,
                                            self.repetition_penalty, self.presence_penalty,
                                            self.frequency_penalty)),
             "sampling values must be finite numbers"),
            (all(math.isfinite(v) for v in (self.logit_bias or {}).values()),
             "logit_bias values must be finite numbers"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # Extra prompt positions worth a prompt-cache checkpoint (e.g. message boundaries), besides
    # every 256-token multiple and the prompt's end.
    checkpoints: list[int] = field(default_factory=list)
    extras: Any = None  # rewind.cache.BlockExtras | None (typed loosely: engine -> cache only)
    # Image prompts (rewind.vision): embed(start, end) -> input embeddings [1, end - start, hidden]
    # of prompt positions [start, end), called on the engine thread for each prefill chunk in
    # place of the token ids. Decode never uses it. None: a text prompt.
    embed: Callable[[int, int], Any] | None = None
    # Image prompts whose language model reads more than the embeddings from the ids it is
    # given (Gemma 4 looks its per-layer inputs up by id, with image tokens as id 0): the ids
    # prefill chunks hand the model, one per prompt token, in place of prompt_tokens. Cache keys,
    # checkpoints and sampling keep prompt_tokens. None: the model gets prompt_tokens.
    model_tokens: list[int] | None = None
    # Models with 3-D rotary positions (Qwen-VL image prompts, rewind.engine.positions):
    # positions(start, end) -> [3, 1, end - start] position ids of those prompt tokens, and the
    # position of generated token i (its index in prompt + answer) is i + position_delta.
    # None: positions are the token indices.
    positions: Callable[[int, int], Any] | None = None
    position_delta: int = 0
    # Models that add features to the hidden states after given layers (Qwen3-VL's deepstack,
    # rewind.engine.residuals): layer_residuals(start, end) -> {layer index: [1, end - start,
    # hidden]} for those prompt positions, or None for a chunk with nothing to add; called on
    # the engine thread for each prefill chunk. Decode never uses it.
    layer_residuals: Callable[[int, int], Mapping[int, Any] | None] | None = None
    # Constrained decoding: an llguidance grammar (rewind.engine.grammar) every generated token
    # must follow, e.g. LLMatcher.grammar_from_json_schema(schema). None: free text.
    grammar: str | None = None
    # Whether its decode steps may draft and verify tokens (rewind.engine.speculation), where
    # the engine speculates at all: a caller opting out gets the same tokens, one a step.
    speculative: bool = True
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache (RAM + disk)
    cached_ram_tokens: int = 0
    cached_disk_tokens: int = 0
    restore_seconds: float = 0.0
    ttft_seconds: float = 0.0  # submit -> first token event
    total_seconds: float = 0.0  # submit -> finish
    queue_seconds: float = 0.0  # submit -> admitted into a running slot
    drafted_tokens: int = 0  # tokens drafted for it and verified (speculative decoding)
    accepted_tokens: int = 0  # of which the model agreed with (emitted for the price of one)


@dataclass
class TokenEvent:
    token: int
    # Text this token released: may be "" (a multi-byte character not complete yet, or text held
    # back because it may still become part of a stop string) or more than this token's own text.
    # The last token event of a request carries whatever was held back (unless a stop matched).
    text: str
    logprob: float | None = None  # log-probability of `token` (set when params.logprobs)
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), best first


FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class FinishEvent:
    reason: FinishReason
    usage: Usage
    error: str | None = None
    stop_string: str | None = None  # which stop string matched, when reason == "stop" by string


Event = TokenEvent | FinishEvent
