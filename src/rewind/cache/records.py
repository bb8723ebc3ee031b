"""Snapshot and restore of mlx-lm caches, one record per layer kind per checkpoint.

Three kinds of record, because each layer kind needs something different to resume at a point:

  kv      full attention (KVCache, QuantizedKVCache): the K/V rows of one block only, a delta.
          The cache at position b is the concatenation of the deltas of every block up to b.
          This record also carries the block's tokens and the key it chains from: it is the spine
          of the chain, checked on every hit, so a hash collision never restores a wrong cache.
  window  sliding window (RotatingKVCache): the window as it stands at the boundary, in temporal
          order and cut to max_size the way the cache itself cuts it. Resuming from exactly these
          rows gives the same keys for the next prefill chunk (the cache drops down to
          max_size - 1 rows before appending) and the same set for a decode step.
  state   recurrent (ArraysCache: gated delta net conv + recurrent state, Mamba): the whole state.

All layers of one kind share one record (arrays named by layer path, e.g. "3.k", "5.1" or, in a
CacheList, "7.0.k"). Records hold copies, not views: a view would keep the whole live cache
buffer alive in the RAM tier and block MLX from updating that buffer in place.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from rewind.cache.serialize import Record

KV, WINDOW, STATE = "kv", "window", "state"
PREALLOC_STEP = 256  # mlx-lm's KVCache.step: restored caches grow like fresh ones


class UnsupportedCacheError(TypeError):
    """A cache class the prompt cache cannot snapshot; the prompt cache turns itself off."""


def leaves(cache: Sequence[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, cache) for every leaf cache, descending into CacheList."""
    for index, layer in enumerate(cache):
        path = f"{prefix}{index}"
        if isinstance(layer, CacheList):
            yield from leaves(layer.caches, prefix=f"{path}.")
        else:
            yield path, layer


def kind_of(layer: Any) -> str:
    # Order matters: check the exact classes mlx-lm uses; subclasses of ArraysCache (MambaCache)
    # are recurrent state too.
    if type(layer) is KVCache or type(layer) is QuantizedKVCache:
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
        name = type(layer).__name__
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
            arrays[f"{path}.k"] = _rows(layer.keys, block.start, block.end)
            arrays[f"{path}.v"] = _rows(layer.values, block.start, block.end)
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


# ---- window and state: the point itself ------------------------------------------------------


def _window(layer: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """The rotating cache's rows in temporal order, cut to max_size as the cache would cut them
    (keeping the first `keep` rows)."""
    keys = layer._temporal_order(layer.keys)
    values = layer._temporal_order(layer.values)
    keys, values = keys[..., : layer.offset, :], values[..., : layer.offset, :]
    excess = keys.shape[2] - layer.max_size
    if excess > 0:
        keys, values = layer._trim(excess, keys), layer._trim(excess, values)
    return keys, values


def snapshot_window(cache: Sequence[Any], end: int) -> Record | None:
    arrays: dict[str, mx.array] = {}
    for path, layer in leaves(cache):
        if kind_of(layer) == WINDOW:
            keys, values = _window(layer)
            arrays[f"{path}.k"], arrays[f"{path}.v"] = _copy(keys), _copy(values)
    if not arrays:
        return None
    mx.eval(list(arrays.values()))
    return Record(arrays=arrays, meta={"kind": WINDOW, "end": str(end)})


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
    `end` in order, and the window / state records at `end` (None where the model has no such
    layers)."""

    end: int
    kv: list[Record]
    window: Record | None
    state: Record | None


def _preallocated(pieces: list[mx.array], end: int) -> mx.array:
    """Concatenate row pieces and pad with zeros to the next multiple of PREALLOC_STEP, the
    shape a KVCache filled in 256-token steps has, so the next update behaves identically."""
    capacity = -(-end // PREALLOC_STEP) * PREALLOC_STEP
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


def rebuild(template: Sequence[Any], parts: RestoreParts) -> list[Any]:
    """Fill the fresh caches in `template` (from make_prompt_cache) so they hold the prefix
    [0, parts.end); returns the template list, ready for prefill or decode."""
    end = parts.end
    restored: list[mx.array] = []
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
            else:
                layer.keys = _preallocated(_rows_of(parts, f"{path}.k"), end)
                layer.values = _preallocated(_rows_of(parts, f"{path}.v"), end)
                restored += [layer.keys, layer.values]
            layer.offset = end
        elif kind == WINDOW:
            if parts.window is None:
                raise ValueError("no window record for a sliding-window layer")
            # Copies: RotatingKVCache writes into its arrays in place (slice assignment), and
            # these arrays also live in the RAM tier.
            layer.keys = _copy(parts.window.arrays[f"{path}.k"])
            layer.values = _copy(parts.window.arrays[f"{path}.v"])
            layer.offset = end
            layer._idx = layer.keys.shape[2]
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
