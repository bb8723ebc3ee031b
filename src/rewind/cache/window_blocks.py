"""A block of new keys written into a full sliding window's ring in place, and given back.

mlx-lm's RotatingKVCache takes a block of several keys by concatenation: the window put in
temporal order (a copy, once the ring has wrapped), its newest max_size - 1 keys and the block
(another copy); the next one-token update then cuts the buffer back to max_size (a third). A
speculative step feeds every drafting row such a block, so on Gemma 3 270M each drafting row
copied its 15 windows three times a step (~4-5 ms of a ~30 ms step on 2 cores).

Here a block goes where one-token updates would put its keys one by one: into the ring's next
slots, over the oldest keys, which are kept aside so that the step's rejected keys can be given
back (their slots get their old keys again). The window is then exactly what one-token steps of
the kept tokens leave: what the same row holds decoding without speculation. Attention over the
block itself does not need the overwritten keys' slots (the CPU kernels read the ring as it was
before the step plus the block: rewind.kernels.native_forward, which the engine's runner hands
this module, as the kernels do not import the cache package).

Only a full ring (max_size slots holding max_size keys, none kept first) and a block shorter
than the window take this; anything else keeps mlx-lm's update.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache



@dataclass
class _Overwritten:
    """The keys and values a block wrote over, valid while the cache is as the block left it."""

    keys_after: weakref.ref  # the cache's keys array right after the block
    offset: int  # and its offset
    start: int  # ring slot of the block's first key
    keys: np.ndarray  # [1, kv_heads, block, D]: the slots' keys before the block
    values: np.ndarray


# layer cache -> what its last block wrote over; an entry goes with its cache.
_OVERWRITTEN: "weakref.WeakKeyDictionary[Any, _Overwritten]" = weakref.WeakKeyDictionary()
written = 0  # blocks written in place in this process (tests check the path ran)


def takes_in_place(layer: Any, rows: int) -> bool:
    """Whether a block of `rows` keys goes into `layer`'s ring in place."""
    keys = getattr(layer, "keys", None)
    return (type(layer) is RotatingKVCache and layer.keep == 0 and isinstance(keys, mx.array)
            and keys.shape[2] == layer.max_size and layer.offset >= layer.max_size
            and 1 < rows < layer.max_size and isinstance(layer._idx, int))


def _first_slot(layer: Any) -> int:
    return layer._idx if layer._idx < layer.max_size else 0


def block_slots(layer: Any, rows: int) -> list[int]:
    """The ring slots a block of `rows` keys will take, in order."""
    start, size = _first_slot(layer), layer.max_size
    return [(start + i) % size for i in range(rows)]


def _write(layer: Any, start: int, keys: mx.array, values: mx.array) -> None:
    """keys / values [1, kv_heads, n, D] into the ring from slot `start`, wrapping once."""
    size, count = layer.max_size, int(keys.shape[2])
    first = min(count, size - start)
    layer.keys[..., start:start + first, :] = keys[..., :first, :]
    layer.values[..., start:start + first, :] = values[..., :first, :]
    if first < count:
        layer.keys[..., :count - first, :] = keys[..., first:, :]
        layer.values[..., :count - first, :] = values[..., first:, :]


def write_in_place(layer: Any, keys: mx.array, values: mx.array, old_keys: np.ndarray,
                   old_values: np.ndarray) -> tuple[mx.array, mx.array]:
    """Write a block (`takes_in_place`) into the ring, keeping the slots' old keys and values
    (copies of `block_slots`' rows, taken before) to give back; returns the window."""
    global written
    size, rows = layer.max_size, int(keys.shape[2])
    start = _first_slot(layer)
    written += 1
    _write(layer, start, keys, values)
    layer.offset += rows
    layer._idx = (start + rows - 1) % size + 1  # mlx-lm's: one past the last slot written
    _OVERWRITTEN[layer] = _Overwritten(weakref.ref(layer.keys), layer.offset, start, old_keys,
                                       old_values)
    return layer.keys, layer.values


def held_block(layer: Any) -> int:
    """The keys of the block `layer` took in place as its last update (unchanged since), else
    0."""
    saved = _OVERWRITTEN.get(layer)
    if saved is None or saved.keys_after() is not layer.keys or saved.offset != layer.offset:
        return 0
    return int(saved.keys.shape[2])


def give_back(layer: Any, tokens: int) -> bool:
    """Take the last `tokens` keys of the block `layer` took in place back out: their slots get
    their old keys and values again. False where its last update was not such a block (or
    something changed it since): mlx-lm's rollback then applies."""
    count = held_block(layer)
    saved = _OVERWRITTEN.pop(layer, None)
    if not count:
        return False
    if not 0 <= tokens <= count:
        raise ValueError(f"a block of {count} keys cannot give back {tokens}")
    if tokens == 0:
        return True
    kept = count - tokens
    _write(layer, (saved.start + kept) % layer.max_size, mx.array(saved.keys[:, :, kept:]),
           mx.array(saved.values[:, :, kept:]))
    layer.offset -= tokens
    layer._idx = (saved.start + kept - 1) % layer.max_size + 1
    return True
