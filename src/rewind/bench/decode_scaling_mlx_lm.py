"""Decode tokens/s of mlx-lm's BatchGenerator on the same model object as Rewind's engine, timed
over --decode-tokens steps once all N sequences are in its generation batch.
"""

from __future__ import annotations

import time
from typing import Any

def run_mlx_lm(model: Any, prompts: list[list[int]], decode_tokens: int) -> dict[str, Any]:
    """mlx-lm's continuous batching on the same model object: greedy, no stop tokens (its way
    of never stopping at EOS), default prefill/completion batch sizes but room for every row."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    streams, prompt_tokens = len(prompts), len(prompts[0])
    generator = BatchGenerator(model, max_tokens=decode_tokens * 4 + 1024,
                               completion_batch_size=max(32, streams))
    try:
        uids = generator.insert(prompts)
        seen: set[int] = set()
        warm_steps = 0
        started = time.perf_counter()
        while len(seen) < streams:  # prefill, and decode steps of the rows already in
            for response in generator.next_generated():
                seen.add(response.uid)
            warm_steps += 1
        prefill_s = time.perf_counter() - started
        tokens = 0
        started = time.perf_counter()
        for _ in range(decode_tokens):
            tokens += len(generator.next_generated())
        seconds = time.perf_counter() - started
        generator.remove(uids)
    finally:
        generator.close()
        del generator
        mx.clear_cache()
    context = prompt_tokens + warm_steps + decode_tokens / 2
    return {"tok_s": round(tokens / seconds, 1), "window_s": round(seconds, 3),
            "window_tokens": tokens, "mean_context": round(context, 1),
            "prefill_s": round(prefill_s, 2), "step_ms": round(1000 * seconds / decode_tokens, 3)}
