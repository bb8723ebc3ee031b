"""Attention through Rewind's C kernel (rewind/native/attention.c) on the CPU.

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

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np

from rewind.engine import native

_KV_FORMS = {mx.float32: native.FORM_F32, mx.bfloat16: native.FORM_BF16}


def _strides(array: np.ndarray) -> native.Strides4:
    return native.Strides4(*(s // array.itemsize for s in array.strides))


def _host(array: mx.array) -> np.ndarray:
    """A NumPy view of an evaluated MLX array (bf16 seen as uint16), no copy."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array)


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


def supported(queries: mx.array, keys: Any, values: Any) -> bool:
    """Whether the kernel takes these inputs (else use MLX's attention)."""
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


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Any = None, threads: int | None = None) -> mx.array | None:
    """softmax(scale * queries @ keys^T + mask) @ values, [B, heads, L, D] float32; None where
    the kernel does not apply (see `supported`)."""
    if not supported(queries, keys, values):
        return None
    batch, heads, length, dim = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    kind, mask_array = _mask_arguments(mask, (batch, heads, length, total))
    queries = queries.astype(mx.float32)
    mx.eval(queries, keys, values, *([] if mask_array is None else [mask_array]))
    q, k, v = _host(queries), _host(keys), _host(values)
    if q.strides[-1] != q.itemsize or k.strides[-1] != k.itemsize or v.strides[-1] != v.itemsize:
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    m = None if mask_array is None else _host(mask_array)
    out = np.empty((batch, heads, length, dim), np.float32)
    args = native.Attention(
        q=q.ctypes.data, k=k.ctypes.data, v=v.ctypes.data,
        qs=_strides(q), ks=_strides(k), vs=_strides(v),
        mask=None if m is None else m.ctypes.data,
        ms=native.Strides4(0, 0, 0, 0) if m is None else _strides(m), mask_kind=kind,
        out=out.ctypes.data, B=batch, heads=heads, kv_heads=kv_heads, L=length, S=total, D=dim,
        scale=float(scale), kv_form=_KV_FORMS[keys.dtype],
        threads=threads or native.kernel_threads())
    status = native.load_kernels().attention(ctypes.byref(args))
    if status != 0:
        return None
    return mx.array(out)
