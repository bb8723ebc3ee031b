"""One sequence without the scheduler: the commands' and benchmarks' generator, on the runner.

It runs the engine's own calls (rewind.engine.runner: the same chunk grid, the same forward
pass, the same output head) and the server's sampler (rewind.engine.sampler), so `rewind
generate` and the server give the same tokens for the same settings. What it adds is a
pipelined decode, as mlx-lm's generate_step: step n+1's graph is built and queued with
`mx.async_eval` before step n's token is read back, so Python overhead overlaps the computation
(on backends that evaluate lazily; the CPU kernels compute as they are called).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from rewind.cache.checkpoints import BLOCK_TOKENS, block_tokens_of, chunk_ends
from rewind.engine.request import SamplingParams
from rewind.engine.runner import ModelRunner, Segment
from rewind.engine.sampler import SequenceSampler

__all__ = ["BLOCK_TOKENS", "Prefilled", "chunk_ends", "decode_tokens", "generate_tokens",
           "greedy_sampler", "prefill_prompt", "prefill_with_cache"]


def cache_offset(cache: list[Any]) -> int:
    """Tokens already in the cache (0 for fresh caches); every layer holds the same count."""
    for layer_cache in cache:
        offset = getattr(layer_cache, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


def greedy_sampler(vocab_size: int) -> SequenceSampler:
    return SequenceSampler(SamplingParams(temperature=0.0), [], vocab_size)


def prefill_prompt(
    model: Any,
    prompt: Sequence[int] | mx.array,
    cache: list[Any],
    on_boundary: Callable[[int, list[Any]], None] | None = None,
    runner: ModelRunner | None = None,
) -> mx.array:
    """Feed prompt [T] (T >= 1) into `cache` and return the last position's logits [1, vocab].

    `on_boundary(position, cache)` is called with the cache evaluated at every absolute position
    that is a multiple of the runner's block size (BLOCK_TOKENS) reached inside the prompt, its
    end included, and lets the prompt cache snapshot blocks as they complete
    (rewind.cache.checkpoints.prefill_plan's `blocks_only`).
    """
    runner = runner or ModelRunner(model)
    tokens = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    return runner.prefill(cache, tokens, cache_offset(cache), on_checkpoint=on_boundary,
                          blocks_only=True)


def _vocab_size(logits: mx.array) -> int:
    return int(logits.shape[-1])


def decode_tokens(
    runner: ModelRunner,
    logits: mx.array,
    cache: list[Any],
    sampler: SequenceSampler | None = None,
    max_tokens: int = 256,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs [vocab]) for up to `max_tokens` tokens, the first sampled from
    `logits` [1, vocab] (the prompt's last position), each next one from a decode step on
    `cache`. The caller stops early by closing the generator.

    The logprobs are lazy: computed only where the caller evaluates them. A log-sum-exp over
    Gemma's 262k-word vocabulary costs ~4 ms on a CPU core, a sixth of a decode step, and
    most callers (`rewind generate`, the speed bench) read only the token."""
    if max_tokens <= 0:
        return
    sampler = sampler or greedy_sampler(_vocab_size(logits))
    # Penalties and grammars need each token accepted before the next step's logits are
    # processed: no step can be queued ahead of reading the token then.
    pipelined = not sampler.needs_history

    def sample(step_logits: mx.array) -> tuple[mx.array, mx.array]:
        row = sampler.process(step_logits[0])
        return sampler.draw(row), row - mx.logsumexp(row)

    token, logprobs = sample(logits)
    mx.async_eval(token)
    for produced in range(max_tokens):
        more = produced + 1 < max_tokens
        if more and pipelined:
            # Queue the next step before reading this one: its graph depends only on `token`.
            step = runner.forward([Segment(token.reshape(1, 1), cache, logits=True)],
                                  evaluate=False)[0]
            next_token, next_logprobs = sample(step)
            mx.async_eval(next_token)
        value = int(token.item())
        sampler.accept(value)
        yield value, logprobs
        if produced % 256 == 255:
            mx.clear_cache()
        if not more:
            return
        if not pipelined:
            step = runner.forward([Segment(mx.array([[value]]), cache, logits=True)])[0]
            next_token, next_logprobs = sample(step)
        token, logprobs = next_token, next_logprobs


def generate_tokens(
    model: Any,
    prompt_tokens: Sequence[int] | mx.array,
    sampler: SequenceSampler | None = None,
    cache: list[Any] | None = None,
    max_tokens: int = 256,
    on_boundary: Callable[[int, list[Any]], None] | None = None,
    runner: ModelRunner | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs [vocab]) for up to `max_tokens` new tokens after `prompt_tokens`.

    `cache` (per-layer caches, e.g. restored by the prompt cache) is filled in place; the prompt
    holds only the tokens not yet in it. The caller stops early by closing the generator.
    """
    runner = runner or ModelRunner(model)
    if cache is None:
        cache = runner.new_cache()
    tokens = prompt_tokens.tolist() if isinstance(prompt_tokens, mx.array) else list(prompt_tokens)
    if not tokens:
        raise ValueError("generate_tokens needs at least one prompt token")
    if max_tokens <= 0:
        return
    logits = prefill_prompt(model, tokens, cache, on_boundary, runner)
    yield from decode_tokens(runner, logits, cache, sampler, max_tokens)


@dataclass
class Prefilled:
    """A prompt run through the model: the live cache, the last position's logits [1, vocab],
    and what the prompt cache restored (None without a prompt cache)."""

    cache: list
    logits: Any
    restored: Any  # rewind.cache.Restored | None


def prefill_with_cache(
    model: Any,
    tokens: Sequence[int],
    prompt_cache: Any,  # rewind.cache.PromptCache | None
    extras: Any = None,  # rewind.cache.BlockExtras | None
    checkpoints: Sequence[int] = (),
    max_kv_size: int | None = None,
) -> Prefilled:
    """Restore, prefill the rest in chunks that end on block boundaries, checkpoint, and return
    the last position's logits: how an engine is meant to drive PromptCache, used by the tests,
    the benchmark and single-process chat.

    Checkpoints follow rewind.cache.checkpoints (the scheduler's rule): every multiple of the
    prompt cache's block size, every position in `checkpoints` (message boundaries), and
    len(tokens) - 1."""
    tokens = list(tokens)
    if not tokens:
        raise ValueError("empty prompt")
    # The engine's calls (the same chunk grid with and without a prompt cache, so the two
    # differ only by the restore); the last token goes alone.
    runner = ModelRunner(model, max_kv_size=max_kv_size, block_tokens=block_tokens_of(prompt_cache))
    if prompt_cache is None:
        cache, position, restored = runner.new_cache(), 0, None
    else:
        restored = prompt_cache.restore(tokens, extras, max_kv_size=max_kv_size)
        cache, position = restored.cache, restored.tokens

    def checkpoint(end: int, held: list[Any]) -> None:
        prompt_cache.checkpoint(tokens[:end], held, extras)

    logits = runner.prefill(cache, tokens[position:], position, checkpoints,
                            checkpoint if prompt_cache is not None else None)
    return Prefilled(cache=cache, logits=logits, restored=restored)
