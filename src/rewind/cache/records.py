"""Snapshot and restore of mlx-lm caches: per-block records, and one record per point.

  kv      the spine, one record per block: the K/V rows of that block only (a delta) of every
          full-attention layer (KVCache, QuantizedKVCache). The cache at position b is the
          concatenation of the deltas of every block up to b. The record also carries the
          block's tokens and the key it chains from, checked on every hit, so a hash collision
          never restores a wrong cache.
  window  per block too, beside its spine record: the rows of the block's sliding-window layers
          (RotatingKVCache, max_size M, keep K) that a later point can still need: its last
          M - K rows, and any of the first K. The window at any point b is its first K rows and
          its last M - K, so a restore reads the window records of the last few blocks before b
          (and of the first block for the K sinks), never the others. Each position is stored
          once, where a snapshot of the whole window at every checkpoint would store it M / 256
          times over and give every message-boundary point a full window of its own.
  state   recurrent (ArraysCache: gated delta net conv + recurrent state, Mamba): the whole
          state at the point, which cannot be rebuilt from deltas.

All layers of a kind share one record (arrays named by layer path, e.g. "3.k", "5.1" or, in a
CacheList, "7.0.k"; a window layer's sink rows as "3.sk"). Records hold copies, not views: a
view would keep the whole live cache buffer alive in the RAM tier and block MLX from updating
that buffer in place. A kv record made here holds its layers' rows stacked in one array, its
named arrays views of it (`Record.stacked`): a restore on a GPU joins every layer's blocks in
one concatenation (`rebuild(..., joined=True)`), where one per layer and keys/values made a
copy kernel per block, layer and kind, each encoded on the host (~1,200 for 9k tokens of
Llama-3.2-1B).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from rewind.cache.blocks import BlockIdentity
from rewind.cache.capacity import capacity_for
from rewind.cache.kv import GrowingKVCache
from rewind.cache.serialize import Record

KV, WINDOW, STATE = "kv", "window", "state"
_KV_CLASSES = (KVCache, GrowingKVCache, QuantizedKVCache)


class UnsupportedCacheError(TypeError):
    """A cache class the prompt cache cannot snapshot; the prompt cache turns itself off."""


class RowsGoneError(ValueError):
    """A sliding window no longer holds rows the block's record needs (a block stored long after
    the prefill passed it): the block cannot be stored from this cache."""


def leaves(cache: Sequence[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, cache) for every leaf cache, descending into CacheList."""
    for index, layer in enumerate(cache):
        path = f"{prefix}{index}"
        if isinstance(layer, CacheList):
            yield from leaves(layer.caches, prefix=f"{path}.")
        else:
            yield path, layer


def kind_of(layer: Any) -> str:
    # Order matters: check the exact classes (mlx-lm's, and Rewind's GrowingKVCache, which holds
    # the same rows); subclasses of ArraysCache (MambaCache) are recurrent state too.
    if type(layer) in _KV_CLASSES:
        return KV
    if type(layer) is RotatingKVCache:
        return WINDOW
    if isinstance(layer, ArraysCache):
        return STATE
    raise UnsupportedCacheError(f"no prompt-cache record for {type(layer).__name__}")


def describe_layout(cache: Sequence[Any]) -> str:
    """A string naming every leaf's class and shape parameters, folded into the root key so a
    cache made another way (max_kv_size, kv_bits) never reads these records."""
    parts = []
    for path, layer in leaves(cache):
        kind_of(layer)  # raises on an unsupported class
        # GrowingKVCache names itself KVCache: same records, so stores written before it match.
        name = getattr(type(layer), "layout_name", type(layer).__name__)
        if isinstance(layer, RotatingKVCache):
            name += f"(max_size={layer.max_size},keep={layer.keep})"
        elif isinstance(layer, QuantizedKVCache):
            name += f"(group_size={layer.group_size},bits={layer.bits})"
        elif isinstance(layer, ArraysCache):
            name += f"(size={len(layer.cache)})"
        parts.append(f"{path}:{name}")
    return ";".join(parts)


def kinds_in(cache: Sequence[Any]) -> set[str]:
    return {kind_of(layer) for _, layer in leaves(cache)}


def cache_offset(cache: Sequence[Any]) -> int | None:
    """Tokens the cache has seen (None when no leaf tracks it, e.g. recurrent only)."""
    for _, layer in leaves(cache):
        if kind_of(layer) in (KV, WINDOW):
            return int(layer.offset)
    return None


def _copy(array: mx.array) -> mx.array:
    return mx.contiguous(array)  # a real copy, also of slices that are already contiguous


def _rows(array: mx.array, start: int, end: int) -> mx.array:
    return _copy(array[..., start:end, :])


# ---- kv: the spine --------------------------------------------------------------------------


def _held_window(layer: RotatingKVCache) -> tuple[mx.array, mx.array, int]:
    """The rotating cache's rows in temporal order, and the position of the first row after its
    `keep` sink rows (all rows are [0, offset) until the cache first drops some)."""
    keys = layer._temporal_order(layer.keys)[..., : layer.offset, :]
    values = layer._temporal_order(layer.values)[..., : layer.offset, :]
    held = keys.shape[2]
    return keys, values, layer.offset - held + layer.keep if held < layer.offset else layer.keep


def _window_rows(layer: RotatingKVCache, start: int, end: int) -> tuple[mx.array, mx.array] | None:
    """Rows of positions [start, end) of a rotating cache, or None when it no longer holds them."""
    if end <= start:
        return None
    keys, values, tail_from = _held_window(layer)
    keep = layer.keep
    if end <= keep or start >= tail_from:
        first = start if end <= keep else keep + start - tail_from
    elif tail_from == keep:  # nothing dropped yet: index = position
        first = start
    else:
        return None
    last = first + end - start
    return _copy(keys[..., first:last, :]), _copy(values[..., first:last, :])


def window_span(layer: RotatingKVCache, start: int, end: int) -> tuple[int, int]:
    """The rows of block [start, end) past its sinks that a later point may need."""
    past_sinks = layer.keep if start < layer.keep else start
    return max(start, end - (layer.max_size - layer.keep), past_sinks), end


def snapshot_kv(cache: Sequence[Any], block: BlockIdentity, extras_digest: str) -> Record:
    """The K/V rows [block.start, block.end) of every full-attention layer, plus the block's
    identity (tokens, the key it chains from, the extras digest) for the check on a hit."""
    arrays: dict[str, mx.array] = {"tokens": mx.array(block.tokens, dtype=mx.int32)}
    meta = {
        "kind": KV,
        "start": str(block.start),
        "end": str(block.end),
        "chained_from": block.chained_from.hex(),
        "extras": extras_digest,
    }
    plain: dict[str, mx.array] = {}  # the rows of plain layers, uncopied
    for path, layer in leaves(cache):
        if kind_of(layer) != KV:
            continue
        if layer.offset < block.end:
            raise ValueError(f"layer {path} holds {layer.offset} tokens, block ends at {block.end}")
        if isinstance(layer, QuantizedKVCache):
            for name, parts in (("k", layer.keys), ("v", layer.values)):
                for index, part in enumerate(parts):
                    arrays[f"{path}.{name}{index}"] = _rows(part, block.start, block.end)
        else:
            plain[f"{path}.k"] = layer.keys[..., block.start:block.end, :]
            plain[f"{path}.v"] = layer.values[..., block.start:block.end, :]
    stacked = _stacked(plain)
    if stacked is None:
        arrays.update({name: _copy(rows) for name, rows in plain.items()})
    else:
        arrays.update({name: stacked[0][i:i + 1] for i, name in enumerate(stacked[1])})
    mx.eval(list(arrays.values()))
    return Record(arrays=arrays, meta=meta, stacked=stacked)


def _stacked(rows: dict[str, mx.array]) -> tuple[mx.array, tuple[str, ...]] | None:
    """The rows [1, H, n, D] of every plain layer in one array [layers, H, n, D] (one copy),
    where they share a shape and dtype; None otherwise (each is copied on its own)."""
    if not rows:
        return None
    first = next(iter(rows.values()))
    if any(a.shape != first.shape or a.dtype != first.dtype or a.shape[0] != 1
           for a in rows.values()):
        return None
    return mx.concatenate(list(rows.values()), axis=0), tuple(rows)


def snapshot_window(cache: Sequence[Any], block: BlockIdentity) -> Record | None:
    """The rows of block [block.start, block.end) of every sliding-window layer that a later
    point may need; None for a model without such layers. RowsGoneError when a layer no longer
    holds them (a block stored long after the prefill passed it)."""
    arrays: dict[str, mx.array] = {}
    meta = {"kind": WINDOW, "start": str(block.start), "end": str(block.end)}
    found = False
    for path, layer in leaves(cache):
        if kind_of(layer) != WINDOW:
            continue
        found = True
        if layer.offset < block.end:
            raise ValueError(f"layer {path} holds {layer.offset} tokens, block ends at {block.end}")
        lo, hi = window_span(layer, block.start, block.end)
        if block.start < layer.keep:
            sinks = _window_rows(layer, block.start, min(block.end, layer.keep))
            if sinks is None:
                raise RowsGoneError(f"layer {path} no longer holds its first rows")
            arrays[f"{path}.sk"], arrays[f"{path}.sv"] = sinks
        if lo < hi:
            rows = _window_rows(layer, lo, hi)
            if rows is None:
                raise RowsGoneError(f"layer {path} no longer holds rows {lo}..{hi}")
            arrays[f"{path}.k"], arrays[f"{path}.v"] = rows
        meta[f"{path}.from"] = str(lo)
    if not found:
        return None
    mx.eval(list(arrays.values()))
    return Record(arrays=arrays, meta=meta)


def verify_kv(record: Record, block: BlockIdentity, extras_digest: str) -> bool:
    """True when `record` was made for exactly this block: same span, tokens, chain and extras."""
    meta = record.meta
    if meta.get("kind") != KV or meta.get("start") != str(block.start):
        return False
    if meta.get("end") != str(block.end) or meta.get("chained_from") != block.chained_from.hex():
        return False
    if meta.get("extras") != extras_digest:
        return False
    tokens = record.arrays.get("tokens")
    return tokens is not None and tuple(tokens.tolist()) == block.tokens


# ---- state: the point itself ---------------------------------------------------------------


def snapshot_state(cache: Sequence[Any], end: int) -> Record | None:
    arrays: dict[str, mx.array] = {}
    meta = {"kind": STATE, "end": str(end)}
    found = False
    for path, layer in leaves(cache):
        if kind_of(layer) != STATE:
            continue
        found = True
        if layer.left_padding is not None or layer.lengths is not None:
            raise ValueError(f"layer {path}: batched ArraysCache (padding) cannot be checkpointed")
        for index, value in enumerate(layer.cache):
            if value is not None:
                arrays[f"{path}.{index}"] = _copy(value)
    if not found:
        return None
    mx.eval(list(arrays.values()))
    return Record(arrays=arrays, meta=meta)


# ---- restore ----------------------------------------------------------------------------------


@dataclass
class RestoreParts:
    """Records that together rebuild the cache at `end`: the kv spine from the first block up to
    `end` in order, the window records of the blocks whose rows the windows at `end` need
    (`window_blocks`, in chain order), and the state record at `end` (None where the model has
    no such layers)."""

    end: int
    kv: list[Record]
    state: Record | None
    window: list[Record] = field(default_factory=list)


def _preallocated(pieces: list[mx.array], end: int) -> mx.array:
    """Concatenate row pieces and pad with zeros to the capacity a fresh cache of `end` rows has
    (rewind.cache.capacity's ladder): the live rows a slice from the start of a buffer whose
    capacity is a multiple of 256 (MLX's CUDA decode attention takes its fused path only for
    such a cache), and the bytes the memory budget counts for them."""
    capacity = capacity_for(end)
    first = pieces[0]
    padding = capacity - end
    if padding:
        pieces = [*pieces, mx.zeros((*first.shape[:2], padding, first.shape[3]), first.dtype)]
    return mx.concatenate(pieces, axis=2)


def _rows_of(parts: RestoreParts, name: str) -> list[mx.array]:
    try:
        return [record.arrays[name] for record in parts.kv]
    except KeyError:
        raise ValueError(f"kv record lacks {name!r}") from None


def window_needed(layer: RotatingKVCache, end: int) -> list[tuple[int, int]]:
    """Position ranges a rotating cache holds at `end`, as the cache itself cuts them: all of
    [0, end) until it exceeds max_size, then its `keep` sinks and its last max_size - keep."""
    if end <= layer.max_size:
        return [(0, end)]
    ranges = [(0, layer.keep)] if layer.keep else []
    return [*ranges, (end - (layer.max_size - layer.keep), end)]


def window_blocks(template: Sequence[Any], blocks: Sequence[tuple[int, int]],
                  end: int) -> list[int]:
    """Indices of the blocks [(start, end), ...] (a restore's spine, in order) whose window rows
    a restore at `end` needs: those that hold any row of some window layer's needed ranges."""
    wanted: set[int] = set()
    for _, layer in leaves(template):
        if kind_of(layer) != WINDOW:
            continue
        for lo, hi in window_needed(layer, end):
            wanted.update(index for index, (start, stop) in enumerate(blocks)
                          if start < hi and lo < stop)
    return sorted(wanted)


def _window_from_records(path: str, layer: RotatingKVCache,
                         parts: RestoreParts) -> tuple[mx.array, mx.array]:
    """The window at parts.end from the window records' rows; ValueError when a needed row is
    in none of them."""
    pieces: list[tuple[int, int, mx.array, mx.array]] = []  # (start, end, keys, values)
    for record in parts.window:
        start, end = int(record.meta["start"]), int(record.meta["end"])
        if f"{path}.sk" in record.arrays:
            sinks = record.arrays[f"{path}.sk"]
            pieces.append((start, start + sinks.shape[2], sinks, record.arrays[f"{path}.sv"]))
        if f"{path}.k" in record.arrays:
            lo = int(record.meta[f"{path}.from"])
            pieces.append((lo, end, record.arrays[f"{path}.k"], record.arrays[f"{path}.v"]))
    pieces.sort(key=lambda piece: piece[0])
    keys: list[mx.array] = []
    values: list[mx.array] = []
    for want_lo, want_hi in window_needed(layer, parts.end):
        position = want_lo
        for lo, hi, k, v in pieces:
            if lo <= position < hi and position < want_hi:
                take = min(hi, want_hi)
                keys.append(k[..., position - lo:take - lo, :])
                values.append(v[..., position - lo:take - lo, :])
                position = take
        if position < want_hi:
            raise ValueError(f"window layer {path}: rows {position}..{want_hi} are in no record")
    if len(keys) == 1:
        return _copy(keys[0]), _copy(values[0])
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)


def window_covered(template: Sequence[Any], parts: RestoreParts) -> bool:
    """Whether the window records hold every window row a restore at parts.end needs."""
    try:
        for path, layer in leaves(template):
            if kind_of(layer) == WINDOW:
                _window_from_records(path, layer, parts)
    except (ValueError, KeyError):
        return False
    return True


# A joined restore's rows are held twice until the next call has written every layer (see
# rebuild): up to this many bytes of them; a larger restore copies layer by layer.
JOINED_BYTES = 1 << 30


def _joined(parts: RestoreParts) -> tuple[mx.array, tuple[str, ...]] | None:
    """Every block's stacked rows joined along the tokens, in a buffer of the ladder's capacity
    (one concatenation), where every spine record has them in one layout and they come to at
    most JOINED_BYTES; else None."""
    stacks = [record.stacked for record in parts.kv]
    if not stacks or any(s is None or s[1] != stacks[0][1] for s in stacks):
        return None
    if sum(s[0].nbytes for s in stacks) > JOINED_BYTES:
        return None
    return _preallocated([s[0] for s in stacks], parts.end), stacks[0][1]


def rebuild(template: Sequence[Any], parts: RestoreParts, joined: bool = False) -> list[Any]:
    """Fill the fresh caches in `template` (from rewind.cache.kv.make_cache) so they hold the prefix
    [0, parts.end); returns the template list, ready for prefill or decode.

    `joined`: plain KV layers' buffers are views of one buffer joined from the records' stacked
    rows, where they have them (one concatenation instead of one a layer and kind). For a GPU:
    a view is copied into a buffer of its own at its layer's first write (MLX updates in place
    only an array that owns its buffer), so until the next call has passed every layer the
    restored rows take twice their bytes (so only up to JOINED_BYTES are joined), but the copies
    are one a layer and kind, not one a block as well."""
    end = parts.end
    restored: list[mx.array] = []
    shared = _joined(parts) if joined else None
    rows_at = {} if shared is None else {name: i for i, name in enumerate(shared[1])}
    for path, layer in leaves(template):
        kind = kind_of(layer)
        if kind == KV:
            if isinstance(layer, QuantizedKVCache):
                layer.keys = tuple(
                    _preallocated(_rows_of(parts, f"{path}.k{i}"), end) for i in range(3)
                )
                layer.values = tuple(
                    _preallocated(_rows_of(parts, f"{path}.v{i}"), end) for i in range(3)
                )
                restored += [*layer.keys, *layer.values]
            elif shared is not None and f"{path}.k" in rows_at and f"{path}.v" in rows_at:
                k, v = rows_at[f"{path}.k"], rows_at[f"{path}.v"]
                layer.keys, layer.values = shared[0][k:k + 1], shared[0][v:v + 1]
                restored += [layer.keys, layer.values]
            else:
                layer.keys = _preallocated(_rows_of(parts, f"{path}.k"), end)
                layer.values = _preallocated(_rows_of(parts, f"{path}.v"), end)
                restored += [layer.keys, layer.values]
            layer.offset = end
        elif kind == WINDOW:
            keys, values = _window_from_records(path, layer, parts)
            # Fresh arrays (a concatenation, or a copy): RotatingKVCache writes into its arrays
            # in place (slice assignment), and the records also live in the RAM tier.
            layer.keys, layer.values = keys, values
            layer.offset = end
            layer._idx = keys.shape[2]
            restored += [layer.keys, layer.values]
        else:
            if parts.state is None:
                raise ValueError("no state record for a recurrent layer")
            layer.cache = [
                _copy(parts.state.arrays[f"{path}.{i}"]) if f"{path}.{i}" in parts.state.arrays else None
                for i in range(len(layer.cache))
            ]
            restored += [value for value in layer.cache if value is not None]
    mx.eval(restored)
    return list(template)
