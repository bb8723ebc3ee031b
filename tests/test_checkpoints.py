"""rewind.cache.checkpoints: the one rule for where prefill calls end and which ends the prompt
cache checkpoints. No model: the rule is plain arithmetic."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from rewind.cache.checkpoints import (
    BLOCK_TOKENS,
    ChunkEnd,
    block_tokens_of,
    check_chunk_tokens,
    chunk_ends,
    decode_checkpoint,
    engine_chunk_tokens,
    is_checkpoint,
    prefill_plan,
)
from rewind.config import CacheConfig


def test_the_block_size_is_the_cache_configs() -> None:
    assert block_tokens_of(None) == BLOCK_TOKENS == CacheConfig().block_tokens == 256
    assert block_tokens_of(SimpleNamespace(block_tokens=32)) == 32
    assert block_tokens_of(object()) == BLOCK_TOKENS  # a cache that does not say


def test_the_call_grid_divides_the_block_size() -> None:
    assert check_chunk_tokens(64, 256) == 64
    assert engine_chunk_tokens(32, 256) == 32
    assert 256 % engine_chunk_tokens(None, 256) == 0
    assert engine_chunk_tokens(None, 48) in (16, 48)  # gcd(64 | 256, 48)
    for bad in (0, 48, 512):
        with pytest.raises(ValueError, match="must divide the block size"):
            engine_chunk_tokens(bad, 256)


def test_checkpoints_are_blocks_message_boundaries_and_the_last_token_but_one() -> None:
    total, boundaries = 700, {100, 300}
    points = [end for end in range(1, total + 1) if is_checkpoint(end, total, 256, boundaries)]
    assert points == [100, 256, 300, 512, 699]
    assert not is_checkpoint(512, 512, 256)  # the prompt's end never is one
    assert is_checkpoint(511, 512, 256)
    assert is_checkpoint(256, 512, 256)


def test_a_plan_cuts_calls_on_the_grid_and_marks_its_checkpoints() -> None:
    plan = prefill_plan(0, 600, 128, 256, boundaries=[300])
    assert plan == [ChunkEnd(128, False), ChunkEnd(256, True), ChunkEnd(300, True),
                    ChunkEnd(384, False), ChunkEnd(512, True), ChunkEnd(599, True),
                    ChunkEnd(600, False)]
    # A restored prefix continues on the same grid; boundaries inside it are gone.
    assert prefill_plan(300, 600, 128, 256, boundaries=[100, 300]) == [
        ChunkEnd(384, False), ChunkEnd(512, True), ChunkEnd(599, True), ChunkEnd(600, False)]
    # One token left (a restore at len - 1): one call, no checkpoint.
    assert prefill_plan(599, 600, 128, 256) == [ChunkEnd(600, False)]


def test_blocks_only_marks_block_ends_and_the_prompts_end() -> None:
    ends = [e.end for e in prefill_plan(0, 530, 64, 256, blocks_only=True) if e.checkpoint]
    assert ends == [256, 512]
    ends = [e.end for e in prefill_plan(0, 512, 64, 256, blocks_only=True) if e.checkpoint]
    assert ends == [256, 512]


# The copies this module replaces, as they were (engine/scheduler.py `_after_chunk`,
# engine/single.py `prefill_with_cache`, commands/common.py `prefill`; and
# engine/single.py `prefill_prompt`), to check the one rule against every one of them.


def _old_prompt_cache_rule(start: int, total: int, chunk: int, block: int,
                           stops: set[int]) -> list[tuple[int, bool]]:
    return [(end, end < total and (end % block == 0 or end in stops or end == total - 1))
            for end in chunk_ends(start, total, chunk, stops)]


def _old_prefill_prompt_rule(start: int, total: int, chunk: int,
                             block: int) -> list[tuple[int, bool]]:
    out = [(end, end < total and end % block == 0) for end in chunk_ends(start, total, chunk)]
    if total % block == 0:
        out[-1] = (total, True)
    return out


@pytest.mark.parametrize("chunk,block", [(64, 256), (256, 256), (16, 32), (1, 4)])
def test_the_rule_is_each_old_copys(chunk: int, block: int) -> None:
    for start, total in itertools.product(range(0, 3 * block + 3, max(block // 8, 1)),
                                          range(1, 3 * block + 5, max(block // 16, 1))):
        if start >= total:
            continue
        stops = {p for p in (0, block // 3, block + 1, total - 1, total, total + 7) if p > 0}
        plan = [(e.end, e.checkpoint)
                for e in prefill_plan(start, total, chunk, block, stops)]
        assert plan == _old_prompt_cache_rule(start, total, chunk, block, stops)
        plan = [(e.end, e.checkpoint)
                for e in prefill_plan(start, total, chunk, block, blocks_only=True)]
        assert plan == _old_prefill_prompt_rule(start, total, chunk, block)


def test_a_decoding_row_checkpoints_every_block_past_its_prompt_and_where_it_ends() -> None:
    assert decode_checkpoint(512, 300, 256, finished=False)
    assert not decode_checkpoint(513, 300, 256, finished=False)
    assert decode_checkpoint(513, 300, 256, finished=True)
    assert not decode_checkpoint(256, 300, 256, finished=False)  # inside the prompt
    assert not decode_checkpoint(300, 300, 256, finished=True)  # the prompt's own end
