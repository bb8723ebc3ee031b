"""Run a model's kernels once at load, so the first request does not pay for building them.

On a GPU the first call of each kernel kind costs far more than the call: MLX's CUDA backend
compiles its fused and custom kernels with NVRTC (kept on disk after, see
rewind.paths.mlx_kernel_cache_dir), and cuBLAS, cuDNN and CUDA graphs build their plans. On an
H200 the first request after start-up took 11-12 s where the same request took under 1 s warm
(issue 27). Warming up runs two short requests of different lengths together through an engine
of its own: prompt chunks, a batch of mixed lengths, sampling and pipelined decode, without the
server's memory account. Where the server caches prompts, a third request then extends the first
one through a prompt cache of the warm-up's own (RAM only, dropped after): a cached turn's
restore, its checkpoints and its short calls have kernels of their own. On an H100 the first
cached turn of a process took ~100 ms where later ones, tails of new lengths included, took ~40.
Last, Rewind's decode attention kernel is built for contexts past these prompts (its spans),
and on CUDA the cuDNN graphs of a full prompt chunk's attention at every KV capacity up to the
model's context (rewind.kernels.prompt_shapes: a graph a capacity, ~36 ms each on an H100).

MLX keeps compiled steps, cuDNN graphs and CUDA graphs per thread: given the model's thread
(rewind.engine.model_thread), the warm-up's engine runs on it, and so does the serving engine
after it; on a thread of its own, only what MLX keeps per process (compiled kernels) would
carry over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rewind.warm_up")

# A full 256-token prompt chunk, a short tail, and a shorter second prompt (a batch of mixed
# lengths); a few decode steps each.
PROMPT_LENGTHS = (300, 40)
DECODE_TOKENS = 4
# The cached turn: the first prompt and this many tokens more.
CACHED_TAIL = 40
WARM_UP_CACHE_BYTES = 256 << 20
# Prompt calls' attention graphs are built for contexts up to this many tokens (18 rungs of the
# KV ladder; the model's own context length where shorter).
PROMPT_GRAPH_TOKENS = 131072


@dataclass(frozen=True)
class WarmUp:
    seconds: float
    generated: int  # tokens generated, every request together
    cached_tokens: int  # the cached turn's prompt tokens restored (0: no cached turn ran)


def warm_up_prompt(tokenizer: Any, length: int) -> list[int]:
    """`length` ids of ordinary text (ids a request could send: no special tokens)."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8,
                           add_special_tokens=False)
    if not ids:
        raise ValueError("the tokenizer encodes the warm-up text to nothing")
    return (ids * (length // len(ids) + 1))[:length]


def warm_up(loaded: Any, engine_config: Any, cache_config: Any = None,
            thread: Any = None) -> WarmUp:
    """Generate up to DECODE_TOKENS tokens for each of PROMPT_LENGTHS' prompts, concurrently,
    through a fresh engine of `loaded` (on `thread`, the model's ModelThread, where given);
    then, with `cache_config` (the server's prompt cache settings: its block size), a cached
    turn through a throwaway RAM-only prompt cache; then the kernels and graphs of longer
    contexts. Raises what the engine raises, and for a request that ends in error."""
    from rewind.cache.capacity import ladder
    from rewind.engine import Engine
    from rewind.kernels import cuda_attention, prompt_shapes
    from rewind.models.catalog import context_length

    started = time.perf_counter()
    cache = _throwaway_cache(loaded, cache_config)
    engine = Engine(loaded, engine_config, cache, None, thread=thread).start()
    try:
        prompts = [warm_up_prompt(loaded.tokenizer, length) for length in PROMPT_LENGTHS]
        generated = sum(tokens for tokens, _ in _generate(engine, prompts))
        cached_tokens = 0
        if cache is not None:
            tail = warm_up_prompt(loaded.tokenizer, PROMPT_LENGTHS[0] + CACHED_TAIL)[-CACHED_TAIL:]
            ((tokens, cached_tokens),) = _generate(engine, [prompts[0] + tail])
            generated += tokens
    finally:
        engine.shutdown()
        if cache is not None:
            cache.close()
    # the attention kernel's variants and the prompt chunks' graphs for contexts longer than
    # these prompts, once the warm-up's engine has stopped, where requests will run
    tokens = min(t for t in (context_length(getattr(loaded, "config", None) or {}),
                             engine_config.max_kv_size, PROMPT_GRAPH_TOKENS) if t)

    def longer_contexts() -> int:
        cuda_attention.warm_kernels()
        return prompt_shapes.warm_graphs(ladder(tokens)) if cuda_attention.available() else 0

    requests_done = time.perf_counter()
    graphs = thread.run(longer_contexts) if thread is not None else longer_contexts()
    finished = time.perf_counter()
    result = WarmUp(finished - started, generated, cached_tokens)
    # the parts apart: where a slow start-up goes (docs/HARDWARE.md, one-off costs on a GPU)
    log.info("warmed up %s in %.2f s (requests %.2f s; longer contexts %.2f s, %d prompt "
             "attention graphs up to %d tokens)", getattr(loaded, "name", "the model"),
             result.seconds, requests_done - started, finished - requests_done, graphs, tokens)
    return result


def _throwaway_cache(loaded: Any, cache_config: Any) -> Any:
    if cache_config is None or not cache_config.enabled:
        return None
    from dataclasses import replace

    from rewind.cache.prompt_cache import PromptCache

    config = replace(cache_config, ram_bytes=WARM_UP_CACHE_BYTES, disk_enabled=False,
                     persist=False, disk_faults=None)
    cache = PromptCache(loaded.model, loaded.fingerprint, config)
    return cache if cache.disabled_reason is None else None


def _generate(engine: Any, prompts: list[list[int]]) -> list[tuple[int, int]]:
    """The prompts run together: each one's tokens generated and prompt tokens restored."""
    from rewind.engine.request import GenerationRequest, SamplingParams

    handles = [engine.submit(GenerationRequest(
        prompt, SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS), speculative=False))
        for prompt in prompts]
    counts = []
    for handle in handles:
        completion = handle.collect(timeout=600)
        finish = completion.finish
        if finish.reason not in ("length", "stop"):
            raise RuntimeError(f"the warm-up request ended with {finish.reason}: "
                               f"{getattr(finish, 'error', None)}")
        usage = handle.usage
        counts.append((len(completion.tokens), usage.cached_tokens if usage is not None else 0))
    return counts
