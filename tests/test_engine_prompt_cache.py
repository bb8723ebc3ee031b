"""The engine with a prompt cache: every request restores and checkpoints, and the cache never
changes the answer."""

from __future__ import annotations

import pytest

from rewind.cache import PromptCache
from rewind.config import CacheConfig, EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams

TIMEOUT = 120

LONG_TEXT = (
    "An agent reads a long conversation again and again, and each turn adds a tool result. "
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    return a\n"
) * 8


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture
def cache_config(tmp_path) -> CacheConfig:
    return CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20)


def test_second_identical_request_is_served_from_the_cache(tiny_loaded, tiny_family, cache_config):
    loaded = tiny_loaded(tiny_family)
    prompt = loaded.tokenizer.encode(LONG_TEXT)
    assert len(prompt) > 300
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        uncached = engine.generate(GenerationRequest(prompt, greedy(10)), TIMEOUT)
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, cache_config)
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            first = engine.generate(GenerationRequest(prompt, greedy(10)), TIMEOUT)
            second = engine.generate(GenerationRequest(prompt, greedy(10)), TIMEOUT)
            stats = engine.stats()
    finally:
        prompt_cache.close()
    assert first.finish.usage.cached_tokens == 0
    # A restore always leaves the last token to compute; the checkpoint at len - 1 covers the rest.
    assert second.finish.usage.cached_tokens == len(prompt) - 1
    assert second.finish.usage.cached_ram_tokens == len(prompt) - 1
    assert second.finish.usage.restore_seconds > 0
    assert first.tokens == uncached.tokens
    assert second.tokens == uncached.tokens
    assert stats["cached_tokens"] == len(prompt) - 1
    assert stats["prefilled_tokens"] == 2 * len(prompt) - (len(prompt) - 1)


def test_next_turn_restores_past_the_previous_answer(tiny_loaded, cache_config):
    """The finish-time checkpoint covers prompt + answer, so a follow-up that re-sends the answer
    computes only what is new, and still decodes exactly as without a cache."""
    loaded = tiny_loaded("qwen3_5")  # recurrent layers: nothing can be rewound, only restored
    tokenizer = loaded.tokenizer
    turn1 = tokenizer.encode(LONG_TEXT)
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, cache_config)
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            answer = engine.generate(GenerationRequest(turn1, greedy(12)), TIMEOUT)
            turn2 = turn1 + answer.tokens + tokenizer.encode(" and one more question",
                                                             add_special_tokens=False)
            second = engine.generate(GenerationRequest(turn2, greedy(8)), TIMEOUT)
    finally:
        prompt_cache.close()
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        reference = engine.generate(GenerationRequest(turn2, greedy(8)), TIMEOUT)
    held_after_answer = len(turn1) + len(answer.tokens) - 1
    assert second.finish.usage.cached_tokens == held_after_answer
    assert second.tokens == reference.tokens


def test_disk_tier_hit_after_ram_is_cleared(tiny_loaded, cache_config):
    loaded = tiny_loaded("gemma3")
    prompt = loaded.tokenizer.encode(LONG_TEXT)
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=cache_config.cache_dir, disk_bytes=64 << 20,
                                           ram_bytes=1))  # every record spills to disk at once
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            first = engine.generate(GenerationRequest(prompt, greedy(6)), TIMEOUT)
            prompt_cache.flush()
            second = engine.generate(GenerationRequest(prompt, greedy(6)), TIMEOUT)
    finally:
        prompt_cache.close()
    assert second.finish.usage.cached_tokens == len(prompt) - 1
    assert second.finish.usage.cached_disk_tokens > 0
    assert second.tokens == first.tokens


def test_requested_checkpoints_serve_a_prompt_that_diverges_there(tiny_loaded, cache_config):
    """A message boundary passed in req.checkpoints is a restore point for a prompt that shares
    only the text before it (an agent that cuts the previous reasoning out)."""
    loaded = tiny_loaded("gemma3")
    tokenizer = loaded.tokenizer
    head = tokenizer.encode(LONG_TEXT[:400])
    first = head + tokenizer.encode(" some reasoning that gets cut out", add_special_tokens=False)
    second = head + tokenizer.encode(" the final answer instead", add_special_tokens=False)
    assert first[: len(head) + 1] != second[: len(head) + 1]
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, cache_config)
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            engine.generate(GenerationRequest(first, greedy(2), checkpoints=[len(head)]), TIMEOUT)
            hit = engine.generate(GenerationRequest(second, greedy(6)), TIMEOUT)
    finally:
        prompt_cache.close()
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        reference = engine.generate(GenerationRequest(second, greedy(6)), TIMEOUT)
    assert hit.finish.usage.cached_tokens == len(head)
    assert hit.tokens == reference.tokens


def test_decode_checkpoints_at_every_block_boundary_held(tiny_loaded, tmp_path):
    """A long answer is checkpointed as it is generated: a later prompt that re-sends part of it
    restores up to the last block boundary the answer crossed. (Blocks of 32 tokens here to keep
    the test short; the engine follows the prompt cache's block size.) The recurrent layers make
    the point: a restore at 64 needs their state at exactly 64, which only decode can record."""
    loaded = tiny_loaded("qwen3_5")
    prompt = loaded.tokenizer.encode("Once upon a time there was a small model")
    assert len(prompt) < 32
    no_eos = {int(t): -1e9 for t in Engine(loaded).eos_token_ids}
    params = SamplingParams(temperature=0.0, max_tokens=80 - len(prompt), logit_bias=no_eos)
    config = CacheConfig(cache_dir=tmp_path, disk_bytes=64 << 20, block_tokens=32)
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, config)
    try:
        with Engine(loaded, EngineConfig(parallel=2), prompt_cache) as engine:
            answer = engine.generate(GenerationRequest(prompt, params), TIMEOUT)
            follow_up = prompt + answer.tokens[: 75 - len(prompt)]
            hit = engine.generate(GenerationRequest(follow_up, greedy(4)), TIMEOUT)
    finally:
        prompt_cache.close()
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        reference = engine.generate(GenerationRequest(follow_up, greedy(4)), TIMEOUT)
    assert len(prompt) + len(answer.tokens) == 80
    assert hit.finish.usage.cached_tokens == 64  # the boundary crossed while decoding
    assert hit.tokens == reference.tokens
