"""The gated delta rule's recurrence in Rewind's C kernel (rewind/kernels/c/gated_delta.c) on the
CPU: what mlx-lm's `gated_delta_ops` computes, without its Python loop of per-token graphs
(rewind.kernels.gated_delta routes mlx-lm's layers here)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from rewind.kernels import boundary, native


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
    boundary.kernels().gated_delta(host_q, host_k, host_v, host_g, host_beta, host_mask,
                                   host_state, out, threads or native.kernel_threads())
    return mx.array(out).astype(q.dtype), mx.array(host_state)
