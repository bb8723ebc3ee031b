"""Attention through Rewind's C kernel (rewind/kernels/c/attention.c) on the CPU.

`attention(queries, keys, values, scale, mask)` computes what
mx.fast.scaled_dot_product_attention computes, for float32 queries and float32 or bf16
keys/values, reading the KV cache's buffers in place. It returns None where the kernel does not
apply (another backend or dtype, a head size the vectors do not divide, no compiled kernels);
callers then use MLX's attention, which gives the same answer more slowly.

Why: MLX's CPU attention materializes every score and runs a scalar exp; at 8.7k tokens of
context a 512-token chunk cost 287 ms per global layer of Gemma 3 270M. The kernel streams key
blocks with an online softmax and skips the blocks a mask rules out.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from rewind import env
from rewind.kernels import boundary, native
from rewind.kernels.host_view import host_view

_KV_FORMS = {mx.float32: native.FORM_F32, mx.bfloat16: native.FORM_BF16}


def _mask_arguments(mask: Any, shape: tuple[int, int, int, int]) -> tuple[int, Any]:
    if mask is None:
        return native.MASK_NONE, None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask mode {mask!r}")
        return native.MASK_CAUSAL, None
    if mask.dtype == mx.bool_:
        return native.MASK_BOOL, mx.broadcast_to(mask, shape)
    return native.MASK_ADD, mx.broadcast_to(mask.astype(mx.float32), shape)


_MLX_LM_CACHE: Any = None


def _mlx_lm_cache() -> Any:
    """mlx_lm.models.cache, imported at first use (importing mlx_lm loads transformers, which
    importing this module should not) and held after: a decode step asks for its classes
    several times a layer, where an import statement costs a lookup through the import system."""
    global _MLX_LM_CACHE
    if _MLX_LM_CACHE is None:
        from mlx_lm.models import cache

        _MLX_LM_CACHE = cache
    return _MLX_LM_CACHE


def _first_and_rotation(cache: Any, total: int) -> tuple[int, int] | None:
    """The absolute position of the oldest of the `total` keys `cache.update_and_fetch` just
    returned, and its buffer index; None where the layout is not known here."""
    module = _mlx_lm_cache()
    KVCache, RotatingKVCache = module.KVCache, module.RotatingKVCache

    offset = getattr(cache, "offset", None)
    if not isinstance(offset, int) or offset < total:
        return None
    if isinstance(cache, RotatingKVCache):
        index = getattr(cache, "_idx", None)
        if cache.keep != 0 or not isinstance(index, int):
            return None
        return offset - total, index % total
    if isinstance(cache, KVCache):
        return offset - total, 0  # rows in order, the newest last (GrowingKVCache too)
    return None


def _layout_arrays(first: int, rotation: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(batch, first, np.int64), np.full(batch, rotation, np.int64)


def key_layout(cache: Any, batch: int, total: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where the `total` keys `cache.update_and_fetch` just returned sit: per batch row, the
    absolute position of the oldest and its index in the buffer (a full sliding window's ring
    holds its oldest key wherever it last wrote). The kernel visits keys in order of position
    from it, so a row's attention rounds the same in any chunking. None (keys in order from
    position 0) for a cache whose layout is not known here: the answer is the same, only its
    rounding may then depend on the chunking."""
    padded = _padded_rows(cache, batch, total)
    if padded is not None:
        return padded
    found = _first_and_rotation(cache, total)
    return None if found is None else _layout_arrays(*found, batch)


def _padded_rows(cache: Any, batch: int, total: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The layout of mlx-lm's left-padded batch caches (BatchKVCache, BatchRotatingKVCache):
    row b's keys start `left_padding[b]` slots after the buffer's oldest slot (a window's ring
    wraps around its write index), and its newest is at its offset. Visited from its oldest key
    by absolute position, a row's keys fall into the blocks they fall into alone, so its
    attention rounds as it does alone, whatever rows share the batch; the padding slots come
    after its newest key, masked. None where the layout is not known here."""
    module = _mlx_lm_cache()
    BatchKVCache, BatchRotatingKVCache = module.BatchKVCache, module.BatchRotatingKVCache

    if isinstance(cache, BatchRotatingKVCache):
        if cache.keys is None or cache._lengths is not None:
            return None
        oldest_slot = cache._idx % total  # the slot after the newest key's, or 0 in order
    elif isinstance(cache, BatchKVCache):
        if getattr(cache, "_idx", None) != total:
            return None
        oldest_slot = 0
    else:
        return None
    padding = np.maximum(np.array(cache.left_padding, dtype=np.int64).reshape(-1), 0)
    offsets = np.array(cache.offset, dtype=np.int64).reshape(-1)
    if padding.shape != (batch,) or offsets.shape != (batch,) or (padding >= total).any():
        return None
    first = offsets - (total - padding)  # the absolute position of each row's oldest key
    if (first < 0).any():
        return None
    return first, (oldest_slot + padding) % total


# The layouts of keys a cache just returned, for layers that attend to another layer's keys and
# get no cache (Gemma 4's KV-shared layers), within one forward call on one thread: by the
# array's id, held by a weak reference (a strong one would keep MLX from updating the cache's
# buffer in place on the next step). Per thread: engines of other models run beside this one.
_layouts = threading.local()
_LAYOUTS_PRUNE_AT = 256


def _layout_table() -> dict[int, tuple[weakref.ref, tuple[np.ndarray, np.ndarray]]]:
    table = getattr(_layouts, "table", None)
    if table is None:
        table = _layouts.table = {}
    return table


def _remember_layout(keys: mx.array, layout: tuple[np.ndarray, np.ndarray] | None) -> None:
    table = _layout_table()
    if layout is None:
        table.pop(id(keys), None)
        return
    if len(table) >= _LAYOUTS_PRUNE_AT:
        for key in [k for k, (ref, _) in table.items() if ref() is None]:
            del table[key]
    table[id(keys)] = (weakref.ref(keys), layout)


def _recalled_layout(keys: mx.array, batch: int) -> tuple[np.ndarray, np.ndarray] | None:
    entry = _layout_table().get(id(keys))
    if entry is None or entry[0]() is not keys or entry[1][0].shape != (batch,):
        return None
    return entry[1]


def supported(queries: Any, keys: Any, values: Any) -> bool:
    """Whether the kernel takes these inputs (else use MLX's attention). `queries` may be an MLX
    array or a NumPy float32 view."""
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        return False  # a quantized cache hands (packed, scales, biases) tuples
    if mx.default_device() != mx.cpu or native.load_kernels() is None:
        return False
    if queries.ndim != 4 or keys.ndim != 4 or keys.dtype not in _KV_FORMS:
        return False
    if values.dtype != keys.dtype or values.shape[-1] != keys.shape[-1]:
        return False
    heads, kv_heads = queries.shape[1], keys.shape[1]
    return heads % kv_heads == 0 and queries.shape[-1] == keys.shape[-1] and \
        queries.shape[-1] % native.vector_width() == 0


def attention_into(queries: np.ndarray, keys: mx.array, values: mx.array, scale: float,
                   mask: Any, out: np.ndarray, threads: int | None = None,
                   cache: Any = None) -> bool:
    """The kernel on host buffers: `queries` and `out` are float32 NumPy views [B, heads, L, D]
    (any strides with a unit last one, e.g. views of a projection's output rows); keys and
    values are the cache's MLX arrays, evaluated here, as `cache` (if given) just returned
    them. False where the kernel does not apply (see `supported`); `out` is then untouched."""
    if not supported(queries, keys, values):
        return False
    batch, heads, length, _ = queries.shape
    total = keys.shape[2]
    kind, mask_array = _mask_arguments(mask, (batch, heads, length, total))
    mx.eval(keys, values, *([] if mask_array is None else [mask_array]))
    # Views of the evaluated MLX arrays, held in this frame (with the arrays they view) until
    # the kernel returns: the boundary checks each against what the kernel indexes.
    k, v = host_view(keys), host_view(values)
    if k.strides[-1] != k.itemsize or v.strides[-1] != v.itemsize:
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    m = None if mask_array is None else host_view(mask_array)
    if cache is not None:
        layout = key_layout(cache, batch, total)
        _remember_layout(keys, layout)
    else:
        layout = _recalled_layout(keys, batch)
    return boundary.kernels().attention(queries, k, v, _KV_FORMS[keys.dtype], m, kind, out,
                                        scale, threads or native.kernel_threads(), layout)


def _updates_in_place(cache: Any) -> bool:
    """Whether a one-token update of `cache` writes the new row into a free slot and moves no
    other: mlx-lm's KVCache and Rewind's GrowingKVCache (they grow by copying rows to the same
    indices), and a RotatingKVCache that keeps no first tokens and holds no more rows than its
    window (else the update trims the buffer's front and every index moves)."""
    module = _mlx_lm_cache()
    KVCache, RotatingKVCache = module.KVCache, module.RotatingKVCache

    if getattr(cache, "keys", None) is None or not isinstance(getattr(cache, "offset", None), int):
        return False
    if type(cache) is RotatingKVCache:
        return cache.keep == 0 and cache.keys.shape[2] <= cache.max_size
    # Rewind's own classes say so (the kernels do not import the cache package).
    return type(cache) is KVCache or getattr(type(cache), "updates_in_place", False) is True


def _layout_after_one(cache: Any) -> tuple[int, tuple[int, int]]:
    """The keys a one-token update of `cache` (one `_updates_in_place` takes) will return, and
    their first position and rotation (see `key_layout`), worked out before the update: the
    offset grows by one; a ring writes at its next index, wrapping at max_size (mlx-lm's
    _update_in_place)."""
    module = _mlx_lm_cache()
    RotatingKVCache = module.RotatingKVCache

    offset = cache.offset + 1
    if type(cache) is RotatingKVCache:
        total = min(offset, cache.max_size)
        index = cache._idx if cache._idx < cache.max_size else cache.keep
        return total, (offset - total, (index + 1) % total)
    return offset, (0, 0)


def tail_layout(cache: Any, rows: int) -> tuple[tuple[int, int, int, int],
                                                  tuple[int, int, int]] | None:
    """Where `rows` new keys of one batch row meet `cache` (float32 keys the kernels read), for
    an attention that reads the cache's buffers as they are plus the new keys (a tail) before
    the update: ((keys, first position, rotation, ring), (keys, first, rotation) the update will
    leave, to check it against). `ring` is the slots the buffer wraps around (0: keys). None for
    a cache whose update is not known here (the caller updates first, then attends).

    One row: a cache whose update writes in place (`_updates_in_place`). Several: mlx-lm's
    KVCache and Rewind's growing cache keep every key in order; a RotatingKVCache that keeps no
    first tokens puts its keys in temporal order and keeps the newest max_size - 1 of them
    before the new ones (mlx-lm's _update_concat), and its mask says which each row sees."""
    module = _mlx_lm_cache()
    KVCache, RotatingKVCache = module.KVCache, module.RotatingKVCache

    keys = getattr(cache, "keys", None)
    offset = getattr(cache, "offset", None)
    if (not isinstance(keys, mx.array) or not isinstance(offset, int) or keys.dtype != mx.float32
            or keys.ndim != 4 or keys.shape[0] != 1 or cache.values.dtype != mx.float32):
        return None
    if rows == 1:
        if not _updates_in_place(cache):
            return None
        total, (first, rotation) = _layout_after_one(cache)
        return (total, first, rotation, 0), (total, first, rotation)
    if type(cache) is RotatingKVCache:
        index, slots = cache._idx, int(keys.shape[2])
        if cache.keep != 0 or not isinstance(index, int):
            return None
        # The buffer as mlx-lm's _temporal_order reads it: `held` keys, the oldest in slot `at`.
        if index == slots:
            held, at = slots, 0
        elif index < offset:
            held, at = slots, index
        else:
            held, at = index, 0
        held = min(held, offset)
        kept = min(held, cache.max_size - 1)
        total, first = kept + rows, offset - kept
        rotation = (at + held - kept) % held if held else 0
        return (total, first, rotation, held), (total, first, 0)
    if type(cache) is KVCache or getattr(type(cache), "updates_in_place", False) is True:
        if int(keys.shape[2]) < offset:
            return None
        return (offset + rows, 0, 0, 0), (offset + rows, 0, 0)
    return None


def moved_as_foreseen(cache: Any, keys: mx.array, layout: tuple[int, int, int]) -> bool:
    """Whether the update that returned `keys` left `cache` as `tail_layout` foresaw."""
    total, first, rotation = layout
    return int(keys.shape[2]) == total and _first_and_rotation(cache, total) == (first, rotation)


def mask_for_kernel(mask: Any, heads: int, rows: int, keys: int) -> tuple[int, Any] | None:
    """(mask kind, [1, heads, rows, keys] host view or None) for one block's mask as mlx-lm
    built it; None where its shape does not fit `keys`."""
    if mask is None or isinstance(mask, str):
        return _mask_arguments(mask, (1, heads, rows, keys))
    if mask.ndim < 1 or mask.shape[-1] != keys or (mask.ndim >= 2 and mask.shape[-2] not in (1, rows)):
        return None
    kind, array = _mask_arguments(mask, (1, heads, rows, keys))
    return kind, host_view(array)


def decode_attention_into(queries: np.ndarray, new_keys: mx.array, new_values: mx.array,
                          cache: Any, scale: float, mask: Any, out: np.ndarray,
                          threads: int | None = None) -> bool:
    """A one-token step's attention without evaluating its cache update: the kernel reads the
    cache's buffers as they are plus this step's own new keys and values, then the update is
    queued (`cache.update_and_fetch`, lazy). Evaluating each layer's update first cost an MLX
    evaluation, ~70 us on 2 cores, 18 times per token for Gemma 3 270M; the caller evaluates
    every layer's update at once after the step (see NativeForward.advance). False (nothing
    done, the cache untouched) where this does not apply: the caller then updates and calls
    `attention_into`. Same bits as that path: the kernel reads the same bf16 rows."""
    if (queries.shape[2] != 1 or not _updates_in_place(cache)
            or not supported(queries, cache.keys, cache.values)
            or cache.keys.dtype != new_keys.dtype or new_keys.shape[2] != 1):
        return False
    batch, heads, length, _ = queries.shape
    total, foreseen = _layout_after_one(cache)
    kind, mask_array = _mask_arguments(mask, (batch, heads, length, total))
    # Views of the buffers as they are (evaluating what is pending: the first step after a
    # prefill). No update of them is queued while the kernel reads them: it comes after.
    old_keys, old_values = host_view(cache.keys), host_view(cache.values)
    tail = (host_view(new_keys), host_view(new_values))
    m = None if mask_array is None else host_view(mask_array)
    done = boundary.kernels().attention(
        queries, old_keys, old_values, _KV_FORMS[new_keys.dtype], m, kind, out, scale,
        threads or native.kernel_threads(), _layout_arrays(*foreseen, batch), tail, total)
    del old_keys, old_values, tail, m
    keys, values = cache.update_and_fetch(new_keys, new_values)
    if not done or not moved_as_foreseen(cache, keys, (total, *foreseen)):
        # Shapes the kernel does not take, or a cache that moved otherwise than foreseen
        # (another mlx-lm): the usual path on the updated cache, whose answer stands.
        if not attention_into(queries, keys, values, scale, mask, out, threads, cache):
            from mlx_lm.models.base import scaled_dot_product_attention

            result = scaled_dot_product_attention(mx.array(queries), keys, values, cache=cache,
                                                  scale=scale, mask=mask)
            out[...] = np.asarray(result.astype(mx.float32))
    return True


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Any = None, threads: int | None = None, cache: Any = None
              ) -> mx.array | None:
    """softmax(scale * queries @ keys^T + mask) @ values, [B, heads, L, D] float32; None where
    the kernel does not apply (see `supported`). `cache`: the KV cache that returned `keys`
    and `values`, whose layout orders the sums (see `key_layout`)."""
    if not supported(queries, keys, values):
        return None
    queries = queries.astype(mx.float32)
    mx.eval(queries)
    q = host_view(queries)
    if q.strides[-1] != q.itemsize:
        q = np.ascontiguousarray(q)
    out = np.empty(queries.shape, np.float32)
    if not attention_into(q, keys, values, scale, mask, out, threads, cache):
        return None
    return mx.array(out)


# REWIND_CPU_ATTENTION=off keeps mlx-lm's own attention in MLX layers (read at each call, so a
# test can compare against it in the same process).
ENV = env.CPU_ATTENTION.name


def _mlx_layers_attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                          mask: Any, sinks: Any = None) -> mx.array:
    """mlx_lm.models.base.scaled_dot_product_attention with the kernel where it applies."""
    from mlx_lm.models import base

    if (sinks is None and not hasattr(cache, "bits") and not env.cpu_attention_off()
            and supported(queries, keys, values)):
        try:
            out = attention(queries, keys, values, scale, mask, cache=cache)
        except (RuntimeError, ValueError):  # e.g. inside mx.compile, where nothing may be evaluated
            out = None
        if out is not None:
            return out.astype(queries.dtype)
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                             mask=mask, sinks=sinks)


def use_in_mlx_layers(model: Any) -> int:
    """Route the attention of `model`'s MLX layers through the kernel on the CPU (families the
    native forward pass does not implement: hybrid linear-attention models, Qwen-VL with
    multimodal positions). mlx-lm's attention modules call their module's
    `scaled_dot_product_attention`; this model's modules call ours instead
    (rewind.kernels.rebind: any other model still calls mlx-lm's), which defers to mlx-lm's for
    anything the kernel does not take. Returns how many modules were changed."""
    from mlx_lm.models import base

    from rewind.kernels.rebind import swap_function

    return swap_function(model, "scaled_dot_product_attention", base.scaled_dot_product_attention,
                         _mlx_layers_attention)
