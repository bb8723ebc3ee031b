"""A fast generator for one sequence: chunked prefill without logits, then pipelined decode.

What it does differently from mlx-lm's `generate_step`, and why:
- prefill chunks end on 256-token boundaries (absolute cache positions), so a caller can
  checkpoint the cache at each boundary (`on_boundary`), the prompt cache's block size;
- no logits are computed during prefill except for the prompt's last position (the output
  projection is most of a small model's prefill cost);
- decode is pipelined as in mlx-lm: step n+1's graph is built and queued with `mx.async_eval`
  before step n's token is read back, so Python overhead overlaps the computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from rewind.engine.forward import last_logits, prefill

BLOCK_TOKENS = 256  # the prompt cache's block size: chunk ends land on multiples of it
DEFAULT_PREFILL_CHUNK = 512  # tokens per prefill chunk (a multiple of BLOCK_TOKENS)

Sampler = Callable[[mx.array], mx.array]  # logprobs [1, vocab] -> token [1]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def cache_offset(cache: list[Any]) -> int:
    """Tokens already in the cache (0 for fresh caches); every layer holds the same count."""
    for layer_cache in cache:
        offset = getattr(layer_cache, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


def chunk_ends(start: int, end: int, chunk: int = DEFAULT_PREFILL_CHUNK) -> list[int]:
    """Absolute end positions of prefill chunks covering [start, end): every end but the last is a
    multiple of BLOCK_TOKENS and each chunk holds at most `chunk` tokens (at least one block)."""
    chunk = max(BLOCK_TOKENS, chunk - chunk % BLOCK_TOKENS)
    ends: list[int] = []
    position = start
    while True:
        limit = position + chunk
        boundary = limit - limit % BLOCK_TOKENS  # > position, since chunk >= BLOCK_TOKENS
        if boundary >= end:
            ends.append(end)
            return ends
        ends.append(boundary)
        position = boundary


def prefill_prompt(
    model: Any,
    prompt: mx.array,
    cache: list[Any],
    chunk: int = DEFAULT_PREFILL_CHUNK,
    on_boundary: Callable[[int, list[Any]], None] | None = None,
) -> mx.array:
    """Feed prompt [T] (T >= 1) into `cache` and return the last position's logits [1, vocab].

    `on_boundary(position, cache)` is called with the cache evaluated at every absolute position
    that is a multiple of BLOCK_TOKENS reached inside the prompt, and lets the prompt cache
    snapshot blocks as they complete.
    """
    start = cache_offset(cache)
    ends = chunk_ends(start, start + prompt.shape[0], chunk)
    position = start
    for end in ends[:-1]:
        prefill(model, prompt[None, position - start:end - start], cache)
        position = end
        if on_boundary is not None:
            on_boundary(position, cache)
        mx.clear_cache()  # chunk temporaries: keep peak memory at one chunk's worth
    logits = last_logits(model, prompt[None, position - start:], cache)
    if on_boundary is not None and ends[-1] % BLOCK_TOKENS == 0:
        mx.eval(logits)
        on_boundary(ends[-1], cache)
    return logits


def _to_logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def generate_tokens(
    model: Any,
    prompt_tokens: Sequence[int] | mx.array,
    sampler: Sampler | None = None,
    cache: list[Any] | None = None,
    max_tokens: int = 256,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    on_boundary: Callable[[int, list[Any]], None] | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs [vocab]) for up to `max_tokens` new tokens after `prompt_tokens`.

    `cache` (mlx-lm per-layer caches, e.g. restored by the prompt cache) is filled in place; the
    prompt holds only the tokens not yet in it. The caller stops early by closing the generator.
    """
    from mlx_lm.models.cache import make_prompt_cache

    sampler = sampler or greedy
    if cache is None:
        cache = make_prompt_cache(model)
    prompt = prompt_tokens if isinstance(prompt_tokens, mx.array) else mx.array(list(prompt_tokens))
    if prompt.size == 0:
        raise ValueError("generate_tokens needs at least one prompt token")
    if max_tokens <= 0:
        return

    logprobs = _to_logprobs(prefill_prompt(model, prompt, cache, prefill_chunk, on_boundary))
    token = sampler(logprobs)
    mx.async_eval(token, logprobs)

    for produced in range(max_tokens):
        if produced + 1 < max_tokens:
            # Queue the next step before reading this one: its graph depends only on `token`.
            next_logprobs = _to_logprobs(last_logits(model, token.reshape(1, 1), cache))
            next_token = sampler(next_logprobs)
            mx.async_eval(next_token, next_logprobs)
        yield int(token.item()), logprobs.squeeze(0)
        if produced % 256 == 255:
            mx.clear_cache()
        if produced + 1 < max_tokens:
            token, logprobs = next_token, next_logprobs
