"""A block of keys written into a full sliding window's ring in place (rewind.cache.window_blocks)
and rolled back (rewind.cache.rollback): the window must be exactly what one-token updates of
the kept keys leave, which is what a row holds decoding without speculation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

from rewind.cache.rollback import roll_back
from rewind.cache.window_blocks import (block_slots, give_back, held_block, takes_in_place,
                                        write_in_place)

WINDOW, HEADS, DIM = 8, 2, 4


def rows(start: int, count: int) -> mx.array:
    """[1, HEADS, count, DIM] keys whose values say their position."""
    positions = mx.arange(start, start + count, dtype=mx.float32)
    return mx.broadcast_to(positions[None, None, :, None], (1, HEADS, count, DIM)) + 0.0


def window_after(offset: int, extra: int = 0) -> RotatingKVCache:
    """A window fed positions 0..offset-1 one token at a time (after one longer prompt)."""
    cache = RotatingKVCache(max_size=WINDOW)
    cache.update_and_fetch(rows(0, 3), rows(0, 3) * 2)
    for position in range(3, offset):
        cache.update_and_fetch(rows(position, 1), rows(position, 1) * 2)
    mx.eval(cache.keys, cache.values)
    return cache


@pytest.mark.parametrize("offset", [8, 11, 13, 16])  # the ring's next slot: 0, 3, 5, 0 (wrapped)
@pytest.mark.parametrize("block, given_back", [(2, 0), (2, 1), (5, 3), (7, 7), (7, 6)])
def test_a_block_given_back_leaves_what_one_token_updates_of_the_kept_keys_leave(
        offset: int, block: int, given_back: int) -> None:
    cache = window_after(offset)
    assert takes_in_place(cache, block)
    slots = block_slots(cache, block)
    keys, values = np.array(cache.keys), np.array(cache.values)
    write_in_place(cache, rows(offset, block), rows(offset, block) * 2,
                   keys[:, :, slots], values[:, :, slots])
    assert held_block(cache) == block and cache.offset == offset + block
    roll_back([cache], given_back)
    assert held_block(cache) == 0

    kept = block - given_back
    reference = window_after(offset + kept)
    assert (cache.offset, cache._idx) == (reference.offset, reference._idx)
    np.testing.assert_array_equal(np.array(cache.keys), np.array(reference.keys))
    np.testing.assert_array_equal(np.array(cache.values), np.array(reference.values))
    # And it goes on as that window does.
    for cache_ in (cache, reference):
        cache_.update_and_fetch(rows(offset + kept, 1), rows(offset + kept, 1) * 2)
    np.testing.assert_array_equal(np.array(cache.keys), np.array(reference.keys))


def test_only_a_full_ring_takes_a_block_and_a_stale_record_is_ignored() -> None:
    assert not takes_in_place(window_after(5), 2)  # the ring is not full yet
    full = window_after(10)
    assert not takes_in_place(full, 1) and not takes_in_place(full, WINDOW)
    assert not takes_in_place(RotatingKVCache(max_size=WINDOW, keep=2), 2)
    slots = block_slots(full, 3)
    write_in_place(full, rows(10, 3), rows(10, 3), np.array(full.keys)[:, :, slots],
                   np.array(full.values)[:, :, slots])
    full.update_and_fetch(rows(13, 1), rows(13, 1))  # a later update: the record is stale
    assert held_block(full) == 0 and not give_back(full, 1)
    with pytest.raises(ValueError, match="right after"):
        roll_back([full], 1)


def test_rollback_refuses_more_than_the_block_before_changing_a_layer() -> None:
    cache = window_after(12)
    slots = block_slots(cache, 3)
    before = np.array(cache.keys)
    write_in_place(cache, rows(12, 3), rows(12, 3), before[:, :, slots],
                   np.array(cache.values)[:, :, slots])
    with pytest.raises(ValueError, match="block of 3"):
        roll_back([cache], 4)
    assert held_block(cache) == 3 and cache.offset == 15
