"""The memory budget inside the engine (rewind.engine.memory_budget): an Engine given an account
admits a sequence only with room for its prompt's cache, grows that room before each step that
makes a token, and ends a row with finish_reason "length" before the token that would cross the
budget. Through the engine's public interface, with no server."""

from __future__ import annotations

import time

import pytest

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, InvalidRequestError, SamplingParams
from rewind.engine.memory_budget import KvAccount, MemoryBudget
from rewind.models.memory_estimate import kv_shape

TIMEOUT = 120


def greedy(max_tokens: int, no_eos: set[int] = frozenset()) -> SamplingParams:
    """Greedy; `no_eos`: token ids banned, so a random tiny model runs to max_tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          logit_bias={token: -1e9 for token in no_eos} or None)


def prompt_of(length: int) -> list[int]:
    return [5 + (i * 11) % 150 for i in range(length)]


def account(loaded, tokens: int) -> KvAccount:
    """A budget with room for exactly one sequence's cache of `tokens` tokens (nothing else is
    counted: no model, no baseline)."""
    kv = kv_shape(loaded.config, 4)
    return KvAccount(MemoryBudget(kv.bytes_for(tokens)), kv, "tiny")


def first_token_count_over(kv, start: int, total: int) -> int:
    """The smallest token count past `start` whose cache takes more than `total` bytes."""
    tokens = start
    while kv.bytes_for(tokens) <= total:
        tokens += 1
    return tokens


@pytest.mark.parametrize("pipelined", [False, True], ids=["unpipelined", "pipelined"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_row_is_cut_with_length_before_the_token_that_would_cross_the_budget(tiny_loaded,
                                                                              family, pipelined):
    loaded = tiny_loaded(family)
    prompt = prompt_of(300)
    memory = account(loaded, 520)
    limit = first_token_count_over(memory.kv, len(prompt), memory.budget.total)
    assert limit < len(prompt) + 2000, "the test needs a budget the answer can cross"
    with Engine(loaded, EngineConfig(parallel=2, pipeline_decode=pipelined),
                memory=memory) as engine:
        no_eos = engine.eos_token_ids
        cut = engine.generate(GenerationRequest(prompt, greedy(2000, no_eos)), TIMEOUT)
    assert cut.finish.reason == "length"
    assert "memory budget" in (cut.finish.error or "")
    # The ticket counts the prompt, the tokens made and the next one: the row stops at the
    # last token whose count fits.
    assert len(prompt) + len(cut.tokens) + 1 == limit
    assert memory.budget.live_bytes() == 0  # its room is given back at the finish
    assert memory.budget.actions["cut_length"] == 1
    # Cut, not changed: the same tokens as an engine with no budget.
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        free = engine.generate(GenerationRequest(prompt, greedy(len(cut.tokens), no_eos)),
                               TIMEOUT)
    assert free.tokens == cut.tokens


def test_a_sequence_waits_for_room_for_its_prompt(tiny_loaded):
    loaded = tiny_loaded("llama")
    memory = account(loaded, 120)  # one 100-token prompt and its answer at a time
    assert memory.kv.bytes_for(101) + memory.kv.bytes_for(91) > memory.budget.total
    with Engine(loaded, EngineConfig(parallel=2), memory=memory) as engine:
        no_eos = engine.eos_token_ids
        before = time.perf_counter()
        first = engine.submit(GenerationRequest(prompt_of(100), greedy(8, no_eos)))
        second = engine.submit(GenerationRequest(prompt_of(90), greedy(8, no_eos)))
        gap = time.perf_counter() - before
        one, two = first.collect(TIMEOUT), second.collect(TIMEOUT)
    assert [one.finish.reason, two.finish.reason] == ["length", "length"]
    assert len(one.tokens) == len(two.tokens) == 8
    # Two slots, but room for one: the second is admitted once the first gave its room back.
    assert two.finish.usage.queue_seconds >= one.finish.usage.total_seconds - gap
    assert memory.budget.live_bytes() == 0


def test_a_prompt_that_can_never_fit_is_refused_at_submit(tiny_loaded):
    loaded = tiny_loaded("llama")
    memory = account(loaded, 64)
    big = prompt_of(first_token_count_over(memory.kv, 64, memory.budget.total))
    with Engine(loaded, EngineConfig(parallel=1), memory=memory) as engine:
        with pytest.raises(InvalidRequestError, match="memory budget"):
            engine.submit(GenerationRequest(big, greedy(4)))
        # The engine goes on serving what fits.
        assert engine.generate(GenerationRequest(prompt_of(10), greedy(3)), TIMEOUT).tokens
    assert memory.budget.actions["refuse_prompt"] == 1
