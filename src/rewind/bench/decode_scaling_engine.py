"""Decode tokens/s of Rewind's engine (what `rewind serve` runs), in process: N prompts submitted
together, tokens stamped by asyncio consumers as the HTTP routes consume them, and the engine's
step calls timed through its step listener.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rewind.bench.decode_scaling_window import all_decoding_window, stagger_tokens

class StepTimers:
    """The engine's three step calls timed through its step listener (Engine.add_step_listener:
    schedule, run, postprocess), without touching what they do. Engine thread only records;
    read after the run."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # (plan's decode rows, its prompt calls, its StepTiming) per step
        self.records: list[tuple[int, int, Any]] = []

    def _record(self, plan: Any, timing: Any) -> None:
        self.records.append((plan.decode_rows, len(plan.prefill), timing))

    def __enter__(self) -> StepTimers:
        self.engine.add_step_listener(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.remove_step_listener(self._record)

    def breakdown(self, start: float, end: float, rows: int) -> dict[str, Any]:
        """Mean milliseconds per pure decode step of all `rows` inside [start, end]."""
        steps = [t for decode_rows, calls, t in self.records
                 if t.started >= start and t.ended <= end and decode_rows == rows and not calls]
        if not steps:
            return {"steps": 0}
        count = len(steps)

        def mean_ms(values: list[float]) -> float:
            return round(sum(values) / count, 3)

        # Steps follow one another on the engine thread: what lies between two is the loop
        # itself (wake-ups) and the events handed to the callers.
        gaps = [b.started - a.ended for a, b in zip(steps, steps[1:])
                if b.started - a.ended < 0.5]
        # a mean hides one slow step (a kernel built, a shape traced) among fast ones
        ordered = sorted(t.total_ms for t in steps)
        return {"steps": count, "step_ms": mean_ms([t.total_ms for t in steps]),
                "step_ms_p50": round(ordered[count // 2], 3),
                "step_ms_p90": round(ordered[min(count - 1, (9 * count) // 10)], 3),
                "step_ms_max": round(ordered[-1], 3),
                "schedule_ms": mean_ms([t.schedule_ms for t in steps]),
                "run_ms": mean_ms([t.run_ms for t in steps]),
                "postprocess_ms": mean_ms([t.postprocess_ms for t in steps]),
                "between_steps_ms": round(1000 * sum(gaps) / len(gaps), 3) if gaps else None}


def run_engine(engine: Any, prompts: list[list[int]], decode_tokens: int, chunk_tokens: int,
               eos_bias: dict[int, float] | None) -> dict[str, Any]:
    """All prompts at once through the engine; token stamps taken where the server takes them
    (an asyncio consumer of each handle, as the HTTP routes consume them)."""
    from rewind.engine import FinishEvent, GenerationRequest, SamplingParams

    streams, prompt_tokens = len(prompts), len(prompts[0])
    max_tokens = decode_tokens + stagger_tokens(streams, prompt_tokens, chunk_tokens)
    stamps: list[list[float]] = [[] for _ in prompts]
    reasons: dict[str, int] = {}

    async def consume(index: int, handle: Any) -> None:
        async for event in handle:
            if isinstance(event, FinishEvent):
                reasons[event.reason] = reasons.get(event.reason, 0) + 1
            else:
                stamps[index].append(time.perf_counter())

    async def main() -> None:
        handles = [engine.submit(GenerationRequest(
            prompt_tokens=prompt,
            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=eos_bias)))
            for prompt in prompts]
        await asyncio.gather(*(consume(i, h) for i, h in enumerate(handles)))

    with StepTimers(engine) as timers:
        started = time.perf_counter()
        asyncio.run(main())
        total = time.perf_counter() - started
    window = all_decoding_window(stamps, prompt_tokens)
    window.finish_reasons = reasons
    end_of_window = min(times[-1] for times in stamps)
    start_of_window = max(times[0] for times in stamps)
    return {"tok_s": round(window.tok_s, 1), "window_s": round(window.seconds, 3),
            "window_tokens": window.tokens, "mean_context": round(window.mean_context, 1),
            "max_tokens": max_tokens, "total_s": round(total, 2), "finish_reasons": reasons,
            "per_step": timers.breakdown(start_of_window, end_of_window, streams)}
