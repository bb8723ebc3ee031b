"""Prompt calls queued without waiting (EngineConfig.queue_prefill, on by default on GPUs): the
engine's answers and its prompt cache's hits are those of the engine that waits for each call.
On the CPU the kernels compute as they are called, so this checks the engine's bookkeeping
around queued calls (which calls are queued, what the runner holds, the checkpoints taken from a
cache whose last call was not waited for), on the path the server runs."""

from __future__ import annotations

import random

import pytest

from rewind.cache.prompt_cache import PromptCache
from rewind.config import CacheConfig, EngineConfig
from rewind.engine import Engine
from rewind.engine.request import GenerationRequest, SamplingParams


def answers(loaded, queue: bool) -> list[tuple[list[int], int]]:
    """Greedy tokens and restored prompt tokens of a cold prompt, the same prompt plus a tail
    (a cached turn), and two prompts at once sharing the first one's prefix."""
    rng = random.Random(7)
    first = [rng.randrange(5, 200) for _ in range(700)]
    tail = [rng.randrange(5, 200) for _ in range(90)]
    other = [rng.randrange(5, 200) for _ in range(300)]
    cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(disk_enabled=False))
    engine = Engine(loaded, EngineConfig(queue_prefill=queue), cache).start()
    out = []
    try:
        for batch in ([first], [first + tail], [first + tail + other, other]):
            handles = [engine.submit(GenerationRequest(
                prompt, SamplingParams(temperature=0.0, max_tokens=6))) for prompt in batch]
            for handle in handles:
                completion = handle.collect(timeout=120)
                assert completion.finish.reason == "length", completion.finish
                out.append((completion.tokens, handle.usage.cached_tokens))
        # The prompts' calls before their last: 700 tokens on the CPU's 128-token grid.
        assert (engine.stats()["queued_prefill_calls"] > 5) is queue
    finally:
        engine.shutdown()
        cache.close()
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_queued_prompt_calls_give_the_same_answers_and_cache_hits(tiny_loaded, family) -> None:
    loaded = tiny_loaded(family)
    waited = answers(loaded, queue=False)
    queued = answers(loaded, queue=True)
    assert queued == waited
    assert waited[1][1] == 699  # the cached turn restored the first prompt's last point but one
