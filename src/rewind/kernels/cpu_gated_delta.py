"""The gated delta rule's recurrence in Rewind's C kernel (rewind/kernels/c/gated_delta.c) on the
CPU: what mlx-lm's `gated_delta_ops` computes, without its Python loop of per-token graphs
(rewind.kernels.gated_delta routes mlx-lm's layers here)."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from rewind.kernels import native


def _host(array: mx.array) -> np.ndarray:
    """A C-contiguous float32 NumPy copy of an evaluated MLX array, the kernel's to write."""
    return np.ascontiguousarray(np.array(array.astype(mx.float32)), dtype=np.float32)


def available() -> bool:
    return mx.default_device() == mx.cpu and native.load_kernels() is not None


def recurrence(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
               state: mx.array, mask: mx.array | None = None,
               threads: int | None = None) -> tuple[mx.array, mx.array]:
    """mlx_lm.models.gated_delta.gated_delta_ops in the kernel: q, k [B, T, Hk, Dk];
    v [B, T, Hv, Dv]; g [B, T, Hv] or [B, T, Hv, Dk]; beta [B, T, Hv]; state [B, Hv, Dv, Dk];
    mask [B, T] or None. Returns (y [B, T, Hv, Dv] in q's dtype, state float32)."""
    batch, steps, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[-2:]
    if g.ndim not in (3, 4):
        raise ValueError(f"unsupported gating shape {g.shape}")
    inputs = [q, k, v, g, beta, state] + ([] if mask is None else [mask])
    mx.eval(inputs)
    host_q, host_k, host_v, host_g, host_beta = map(_host, (q, k, v, g, beta))
    host_state = _host(state)
    host_mask = None if mask is None else np.ascontiguousarray(
        np.array(mx.broadcast_to(mask, (batch, steps)).astype(mx.uint8)))
    out = np.empty((batch, steps, value_heads, value_dim), np.float32)
    args = native.GatedDelta(
        q=host_q.ctypes.data, k=host_k.ctypes.data, v=host_v.ctypes.data,
        g=host_g.ctypes.data, beta=host_beta.ctypes.data,
        mask=None if host_mask is None else host_mask.ctypes.data,
        state=host_state.ctypes.data, y=out.ctypes.data,
        B=batch, T=steps, Hk=key_heads, Hv=value_heads, Dk=key_dim, Dv=value_dim,
        g_per_key=int(g.ndim == 4), threads=threads or native.kernel_threads())
    if native.load_kernels().gated_delta(ctypes.byref(args)) != 0:
        raise ValueError(f"gated delta kernel: {value_heads} value heads do not group over "
                         f"{key_heads} key heads")
    return mx.array(out).astype(q.dtype), mx.array(host_state)
