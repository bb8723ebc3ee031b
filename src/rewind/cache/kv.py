"""Rewind's full-attention KV caches: mlx-lm's, with buffers that grow geometrically.

Why: mlx-lm's KVCache (and BatchKVCache) grows its buffer 256 positions at a time, each growth a
copy of the whole buffer, so at 8k of context one append in 256 copies 8k rows: the amortized
cost of a token grows with the context (benchmarks/probes/kv_append.py: 2.0 ms a step at 512,
13.1 ms at 8,192). Here a buffer's capacity is the rung of a geometric ladder
(rewind.cache.capacity: 256, 512, 768, 1024, 1536, 2048, 3072, ...) that holds its rows, never
past the request's bound where one is given, so a token costs the same at 8k as at 512, and the
memory budget counts exactly the capacity a cache of n tokens has.

What stays as mlx-lm has it, because other code relies on it:
- The capacity is a multiple of STEP (256) and the live K/V is the slice [..., :offset, :] of one
  contiguous buffer that starts at the buffer's start: MLX's CUDA backend takes its fused cuDNN
  decode attention only for such a slice (`kv_cache_step = 256` in its
  scaled_dot_product_attention.cpp, which reads the buffer's capacity from the slice's strides
  and the rows from its start). mlx-lm itself can break this (a growth after an offset that is not
  a multiple of 256 gives a capacity that is not; `filter` leaves a slice that starts past the
  buffer's start; `extract` gives an exact-size buffer); these classes do not.
- `state` is (keys, values, offset), resp. BatchKVCache's five fields, so the prompt cache's
  records, `rewind cache-prompt` files and mlx-lm's from_state keep working.
- Every method the model calls computes the same keys, values and masks, so answers do not change.

Only plain KVCache layers are swapped (see `make_cache`); sliding-window (RotatingKVCache, bounded
by its window), linear-attention (ArraysCache) and quantized caches stay mlx-lm's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, make_prompt_cache

from rewind.cache.capacity import STEP, capacity_for, next_capacity

# Per thread (each model's engine runs its steps on a thread of its own): the last decode-step
# mask a GrowingBatchKVCache made from left padding alone.
_decode_masks = threading.local()


def repack(array: mx.array, start: int, stop: int, capacity: int) -> mx.array:
    """A new buffer of `capacity` rows (axis 2) whose first rows are array[..., start:stop, :]
    and the rest zeros, so the live rows start at the buffer's start. Zeros written into in
    place, not a concatenation with a block of zeros: one allocation instead of two, and a
    growth's cost is mostly fresh memory."""
    rows = array[..., start:stop, :]
    buffer = mx.zeros((*rows.shape[:2], capacity, rows.shape[3]), rows.dtype)
    buffer[..., : stop - start, :] = rows
    return buffer


def _fitted(array: mx.array | None, live: int) -> mx.array | None:
    """`array` itself when its capacity is a multiple of STEP, else repacked to the ladder's
    (a buffer from mlx-lm's growth or extract, or from a file those made)."""
    if array is None or array.shape[2] % STEP == 0:
        return array
    return repack(array, 0, live, capacity_for(live))



def _append(cache: Any, held: int, keys: mx.array, values: mx.array,
            bound: int | None = None) -> int:
    """Write keys/values [B, H, L, D] after the `held` rows of cache.keys/values, growing the
    buffers up the capacity ladder (one copy per rung, not per 256 tokens); returns the rows
    held after."""
    needed = held + keys.shape[2]
    if cache.keys is None or needed > cache.keys.shape[2]:
        capacity = next_capacity(needed, bound)
        if cache.keys is None:
            batch, heads = keys.shape[:2]
            cache.keys = mx.zeros((batch, heads, capacity, keys.shape[3]), keys.dtype)
            cache.values = mx.zeros((batch, heads, capacity, values.shape[3]), values.dtype)
        else:
            cache.keys = repack(cache.keys, 0, held, capacity)
            cache.values = repack(cache.values, 0, held, capacity)
    cache.keys[..., held:needed, :] = keys
    cache.values[..., held:needed, :] = values
    return needed

class GrowingKVCache(KVCache):
    """mlx-lm's KVCache whose buffer grows along the capacity ladder (see the module's
    docstring)."""

    # The prompt cache's record layout and key name this class as mlx-lm's: the records are the
    # same, so stores written before this class existed keep matching.
    layout_name = "KVCache"
    bound: int | None = None  # a class default too: from_state makes objects without __init__
    # A one-token update writes the next slot and moves no other row (the buffer grows by
    # copying rows to the same indices): the CPU decode step may read the buffer as it was
    # plus the new row (rewind.kernels.cpu_attention.decode_attention_into).
    updates_in_place = True

    def __init__(self, bound: int | None = None) -> None:
        super().__init__()
        self.bound = bound

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset = _append(self, self.offset, keys, values, self.bound)
        return self.keys_and_values()

    @staticmethod
    def ladder_rows(tokens: int) -> int:
        """The ladder's rung for `tokens` rows: what a prompt call's attention reads on CUDA
        (rewind.kernels.prompt_shapes), the same rows whatever this buffer's history."""
        return capacity_for(tokens)

    @property
    def state(self) -> tuple[Any, Any, int]:
        """mlx-lm's (keys, values, offset), the buffers cut to the ladder's capacity for offset
        rows: a cache trimmed after it grew does not save its spare rows."""
        rows = None if self.keys is None else min(self.keys.shape[2], capacity_for(self.offset))
        if rows is None or rows == self.keys.shape[2]:
            return self.keys, self.values, self.offset
        return self.keys[..., :rows, :], self.values[..., :rows, :], self.offset

    @state.setter
    def state(self, value: tuple[Any, Any, int]) -> None:
        keys, values, offset = value
        self.keys, self.values, self.offset = _fitted(keys, offset), _fitted(values, offset), offset

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> GrowingBatchKVCache:
        return GrowingBatchKVCache.merge(caches)


class GrowingBatchKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache (left-padded rows, one buffer) growing along the capacity ladder,
    with merge, extend, filter and extract that keep the live rows a slice from the start of a
    buffer whose capacity is a multiple of STEP."""

    # Whether no row has left padding (None: not known since the rows last changed). Kept on the
    # host so choosing the mask costs no device sync per step.
    _unpadded: bool | None = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        """Without padding (one row, or rows of one length): what a plain KVCache gives, no mask
        for a decode step and "causal" for a chunk, which MLX's fused attention takes (cuDNN on
        CUDA refuses any array mask); mlx-lm's array mask otherwise. A decode step's mask
        without a window is remembered (see `left_padding_only`)."""
        if not return_array and kwargs.get("window_size") is None and self._no_padding():
            return None if N == 1 else "causal"
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if N == 1 and kwargs.get("window_size") is None and isinstance(mask, mx.array):
            _decode_masks.last = weakref.ref(mask)
        return mask

    def left_padding_only(self, mask: Any) -> bool:
        """Whether `mask` is the decode-step mask this thread's last `make_mask` made from left
        padding alone: row b's keys are slots [left_padding[b], _idx) of every such cache in
        the batch. An attention kernel that takes per-row starts (rewind.kernels
        .cuda_attention) then needs no mask."""
        last = getattr(_decode_masks, "last", None)
        return last is not None and last() is mask

    def _no_padding(self) -> bool:
        if self._unpadded is None:
            self._unpadded = max(self.left_padding.tolist(), default=0) == 0
        return self._unpadded

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset = self.offset + keys.shape[2]
        self._idx = _append(self, self._idx, keys, values)
        return self.keys_and_values()

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> GrowingBatchKVCache:
        """One row per cache, right-justified to the longest (mlx-lm's merge), in a buffer of
        the ladder's capacity for the longest instead of exactly the longest."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches))
        filled = [c for c in caches if c.keys is not None]
        heads = max(c.keys.shape[1] for c in filled)
        key_dim = max(c.keys.shape[3] for c in filled)
        value_dim = max(c.values.shape[3] for c in filled)
        dtype = filled[0].keys.dtype
        capacity = capacity_for(longest)
        keys = mx.zeros((len(caches), heads, capacity, key_dim), dtype)
        values = mx.zeros((len(caches), heads, capacity, value_dim), dtype)
        padding = [longest - length for length in lengths]
        for row, (pad, cache) in enumerate(zip(padding, caches)):
            if cache.keys is None:
                continue
            keys[row:row + 1, :, pad:pad + cache.offset] = cache.keys[..., :cache.offset, :]
            values[row:row + 1, :, pad:pad + cache.offset] = cache.values[..., :cache.offset, :]
        merged = cls(padding)
        merged.keys, merged.values = keys, values
        merged.offset = merged.offset + longest
        merged._idx = longest
        return merged

    def extend(self, other: BatchKVCache) -> None:
        """mlx-lm's extend (rows right-justified to the longer _idx, in a buffer as long as the
        longer one), each row copied once into the new buffer: mlx-lm pads and then
        concatenates, two copies of the whole batch, and a sequence joining the decode batch
        stalls every decoding row for them (~16 ms a layer for three 6k-token rows on 2 cores).
        A buffer that is not on the ladder is refitted to STEP."""
        if self.keys is None or other.keys is None:
            super().extend(other)
        else:
            longest = max(self._idx, other._idx)
            capacity = max(self.keys.shape[2], other.keys.shape[2])
            rows = self.keys.shape[0]

            def joined(mine: mx.array, theirs: mx.array) -> mx.array:
                buffer = mx.zeros((rows + theirs.shape[0], mine.shape[1], capacity,
                                   mine.shape[3]), mine.dtype)
                buffer[:rows, :, longest - self._idx:longest, :] = mine[..., :self._idx, :]
                buffer[rows:, :, longest - other._idx:longest, :] = theirs[..., :other._idx, :]
                return buffer

            self.keys = joined(self.keys, other.keys)
            self.values = joined(self.values, other.values)
            self.offset = mx.concatenate([self.offset, other.offset])
            self.left_padding = mx.concatenate([self.left_padding + (longest - self._idx),
                                                other.left_padding + (longest - other._idx)])
            self._idx = longest
        self.keys, self.values = _fitted(self.keys, self._idx), _fitted(self.values, self._idx)
        self._unpadded = None

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep the given rows; drop the left padding every kept row shares. mlx-lm's filter
        drops it by slicing the buffer's front off, which leaves the live rows past the buffer's
        start; here they are copied to the start of a fresh buffer instead."""
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                capacity = capacity_for(self._idx - shift)
                self.keys = repack(self.keys, shift, self._idx, capacity)
                self.values = repack(self.values, shift, self._idx, capacity)
            self._idx -= shift
            self.left_padding -= shift
        self._unpadded = None

    def extract(self, idx: int) -> GrowingKVCache:
        """Row `idx` alone, without its padding, as a batch-1 cache (the ladder's capacity)."""
        cache = GrowingKVCache()
        padding = int(self.left_padding[idx].item())
        rows = self._idx - padding
        cache.keys = repack(self.keys[idx:idx + 1], padding, self._idx, capacity_for(rows))
        cache.values = repack(self.values[idx:idx + 1], padding, self._idx, capacity_for(rows))
        cache.offset = rows
        return cache


def _swapped(layer: Any, bound: int | None) -> Any:
    """A fresh layer cache with a plain KVCache replaced by a GrowingKVCache (inside a CacheList
    too); any other class is the model's own choice and stays."""
    if type(layer) is KVCache and layer.empty():
        return GrowingKVCache(bound)
    if type(layer) is CacheList:
        return CacheList(*(_swapped(inner, bound) for inner in layer.caches))
    return layer


def make_cache(model: Any, max_kv_size: int | None = None, bound: int | None = None) -> list[Any]:
    """The model's fresh per-layer cache, as mlx-lm's make_prompt_cache builds it (the model's own
    make_cache where it has one, RotatingKVCache layers under max_kv_size), with every plain
    KVCache a GrowingKVCache. `bound`: the most tokens the cache will hold (prompt + answer),
    when known; growth then stops there instead of going up the ladder past it."""
    return [_swapped(layer, bound) for layer in make_prompt_cache(model, max_kv_size=max_kv_size)]


# Class names a saved cache file may name (`rewind cache-prompt` files, written by mlx-lm's
# save_prompt_cache): a plain KVCache in a file (from mlx-lm, or from Rewind before these classes)
# loads as a GrowingKVCache.
_SAVED_CLASSES: dict[str, type] = {
    "KVCache": GrowingKVCache,
    "GrowingKVCache": GrowingKVCache,
    "BatchKVCache": GrowingBatchKVCache,
    "GrowingBatchKVCache": GrowingBatchKVCache,
}


def from_saved(name: str, state: Any) -> Any:
    """The cache a saved (class name, state) pair describes. mlx-lm's loader looks names up in its
    own module only, which lacks these classes, also inside a CacheList (whose state is a list of
    (state, name) pairs), so Rewind loads through here."""
    from mlx_lm.models import cache as mlx_caches

    if name == "CacheList":
        return CacheList(*(from_saved(inner, inner_state) for inner_state, inner in state))
    cls = _SAVED_CLASSES.get(name) or getattr(mlx_caches, name, None)
    if not (isinstance(cls, type) and issubclass(cls, mlx_caches._BaseCache)):
        raise ValueError(f"no cache class {name!r}")
    return cls.from_state(state)
