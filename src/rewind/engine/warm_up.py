"""Run a model's kernels once at load, so the first request does not pay for building them.

On a GPU the first call of each kernel kind costs far more than the call: MLX's CUDA backend
compiles its fused and custom kernels with NVRTC (kept on disk after, see
rewind.paths.mlx_kernel_cache_dir), and cuBLAS, cuDNN and CUDA graphs build their plans. On an
H200 the first request after start-up took 11-12 s where the same request took under 1 s warm
(issue 27). Warming up runs two short requests of different lengths together through an engine
of its own: prompt chunks, a batch of mixed lengths, sampling and pipelined decode, without a
prompt cache (nothing of it is kept) and without the server's memory account.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("rewind.warm_up")

# A full 256-token prompt chunk, a short tail, and a shorter second prompt (a batch of mixed
# lengths); a few decode steps each.
PROMPT_LENGTHS = (300, 40)
DECODE_TOKENS = 4


def warm_up_prompt(tokenizer: Any, length: int) -> list[int]:
    """`length` ids of ordinary text (ids a request could send: no special tokens)."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8,
                           add_special_tokens=False)
    if not ids:
        raise ValueError("the tokenizer encodes the warm-up text to nothing")
    return (ids * (length // len(ids) + 1))[:length]


def warm_up(loaded: Any, engine_config: Any) -> tuple[float, int]:
    """Generate up to DECODE_TOKENS tokens for each of PROMPT_LENGTHS' prompts, concurrently,
    through a fresh engine of `loaded`; returns (seconds, tokens generated). Raises what the
    engine raises, and for a request that ends in error."""
    from rewind.engine import Engine
    from rewind.engine.request import GenerationRequest, SamplingParams

    started = time.perf_counter()
    engine = Engine(loaded, engine_config, None, None).start()
    try:
        handles = [engine.submit(GenerationRequest(
            warm_up_prompt(loaded.tokenizer, length),
            SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS), speculative=False))
            for length in PROMPT_LENGTHS]
        generated = 0
        for handle in handles:
            completion = handle.collect(timeout=600)
            generated += len(completion.tokens)
            finish = completion.finish
            if finish.reason not in ("length", "stop"):
                raise RuntimeError(f"the warm-up request ended with {finish.reason}: "
                                   f"{getattr(finish, 'error', None)}")
    finally:
        engine.shutdown()
    seconds = time.perf_counter() - started
    log.info("warmed up %s in %.2f s", getattr(loaded, "name", "the model"), seconds)
    return seconds, generated
