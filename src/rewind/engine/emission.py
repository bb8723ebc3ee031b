"""Tokens out of the engine: each generated token to its request's stream, each finish once.

The scheduler decides which sequence gets which token; this is what happens to one token once
decided (timings to the sample listeners, the text stream and its stop strings, max_tokens, the
end-of-sequence ids) and what ending a request does (usage, counters, the speculator's record,
the FinishEvent). It runs on the engine thread, called by the scheduler and its verifier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rewind.engine.request import FinishEvent, FinishReason, TokenEvent
from rewind.engine.sampler import Sampled
from rewind.engine.sequence import Sequence
from rewind.engine.speculation import Speculator, tenant_of

log = logging.getLogger(__name__)

__all__ = ["Counters", "Emission", "SampleListener"]

SampleListener = Callable[[str, float], None]


@dataclass
class Counters:
    requests_finished: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prefilled_tokens: int = 0  # prompt tokens actually computed
    generated_tokens: int = 0
    cached_tokens: int = 0
    cached_ram_tokens: int = 0
    cached_disk_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    steps: int = 0  # engine steps that ran the model
    pipelined_steps: int = 0  # of which decode steps queued before the previous was read
    # Prefill work in prompt tokens x layers passed (x the layer count where calls stop between
    # layers; one "layer" a call elsewhere), and the chunk calls that stopped between layers.
    prefill_token_layers: int = 0
    partial_chunk_calls: int = 0
    # Prefill-only passes a mixed step ran after the decoding rows' (a sequence's next call).
    extra_prefill_passes: int = 0


class Emission:
    """Emits tokens and finishes requests for one scheduler, counting into its Counters."""

    def __init__(self, counters: Counters, eos_token_ids: set[int],
                 listeners: list[SampleListener], speculator: Speculator | None) -> None:
        self.counters = counters
        self.eos_token_ids = eos_token_ids
        # The engine's own list: a listener added later (Engine.add_listener) is heard too.
        self.listeners = listeners
        self.speculator = speculator
        self.typical_request_seconds = 0.0  # moving average over finished requests

    def on_token(self, seq: Sequence, sampled: Sampled) -> bool:
        """Emit one generated token; True while the sequence goes on. A failure here (say, in
        detokenization) ends this request only."""
        try:
            return self._emit_token(seq, sampled)
        except Exception as exc:
            log.exception("token handling failed for %s", seq.request.request_id)
            self.finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return False

    def _emit_token(self, seq: Sequence, sampled: Sampled) -> bool:
        now = time.perf_counter()
        if not seq.generated:
            seq.usage.ttft_seconds = now - seq.submitted_at
            self.notify("ttft_seconds", seq.usage.ttft_seconds)
        else:
            self.notify("itl_seconds", now - seq.last_token_at)
        seq.last_token_at = now
        token = sampled.token
        seq.generated.append(token)
        seq.sampler.accept(token)
        seq.next_input = token
        self.counters.generated_tokens += 1

        reason: FinishReason | None = None
        stop_string = None
        if token in self.eos_token_ids:
            step = seq.text.finish()
            reason = "stop"
        else:
            step = seq.text.add(token)
            if step.stop is not None:
                reason, stop_string = "stop", step.stop
            elif len(seq.generated) >= seq.request.params.max_tokens:
                tail = seq.text.finish()
                step.text += tail.text
                reason, stop_string = ("stop", tail.stop) if tail.stop else ("length", None)
        seq.emit(TokenEvent(token, step.text, sampled.logprob, sampled.top_logprobs))
        if reason is not None:
            self.finish(seq, reason, stop_string=stop_string)
            return False
        return True

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
               stop_string: str | None = None) -> None:
        usage = seq.usage
        usage.completion_tokens = len(seq.generated)
        usage.total_seconds = time.perf_counter() - seq.submitted_at
        if reason in ("stop", "length"):
            previous = self.typical_request_seconds
            self.typical_request_seconds = (usage.total_seconds if previous == 0.0
                                            else 0.8 * previous + 0.2 * usage.total_seconds)
        self.counters.requests_finished += 1
        if self.speculator is not None:
            self.speculator.finished(seq.drafts, tenant_of(seq.request.extras), seq.generated)
            seq.drafts = None
        reasons = self.counters.finish_reasons
        reasons[reason] = reasons.get(reason, 0) + 1
        if seq.ticket is not None:  # its cache's room in the memory budget
            seq.ticket.release()
        seq.emit(FinishEvent(reason, usage, error, stop_string))
        seq.admitted.set()

    def notify(self, name: str, value: float) -> None:
        for listener in self.listeners:
            try:
                listener(name, value)
            except Exception:  # a metrics hook must not break generation
                log.exception("sample listener failed")
