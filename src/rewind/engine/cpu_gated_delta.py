"""The gated delta rule of Qwen 3.5 / Qwen3-Next linear attention through Rewind's C kernel
(rewind/native/gated_delta.c) on the CPU.

mlx-lm runs the recurrence in a Metal kernel, or elsewhere in `gated_delta_ops`: a Python loop
that builds and evaluates a graph per token per layer. On the CPU that loop was about half of a
Qwen 3.5 0.8B-sized prefill (`rewind bench gated-delta`). `use_in_mlx_layers(model)` points the
model's modules at `gated_delta_update`, which takes mlx-lm's arguments, computes the gates
with mlx-lm's own functions and runs the recurrence in the kernel; it defers to mlx-lm's
function off the CPU, without the kernels, or with REWIND_CPU_GATED_DELTA=off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import mlx.core as mx
import numpy as np

from rewind.engine import native

ENV = "REWIND_CPU_GATED_DELTA"  # "off": mlx-lm's own path (read at each call, for tests)


def _host(array: mx.array) -> np.ndarray:
    """A C-contiguous float32 NumPy copy of an evaluated MLX array, the kernel's to write."""
    return np.ascontiguousarray(np.array(array.astype(mx.float32)), dtype=np.float32)


def applies() -> bool:
    return (os.environ.get(ENV) != "off" and mx.default_device() == mx.cpu
            and native.load_kernels() is not None)


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


def gated_delta_update(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                       A_log: mx.array, dt_bias: mx.array, state: mx.array | None = None,
                       mask: mx.array | None = None, *, use_kernel: bool = True,
                       lower_bound: float | None = None,
                       allow_neg_eigval: bool = False) -> tuple[mx.array, mx.array]:
    """mlx_lm.models.gated_delta.gated_delta_update with the recurrence in the kernel where it
    applies."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    if not applies():
        return mlx_gated_delta.gated_delta_update(
            q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
            lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    # The gates exactly as mlx-lm computes them; only the recurrence moves.
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = mlx_gated_delta.compute_g(A_log, a, dt_bias)
    else:
        g = mlx_gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    if state is None:
        batch, _, _, key_dim = q.shape
        value_heads, value_dim = v.shape[-2:]
        state = mx.zeros((batch, value_heads, value_dim, key_dim), dtype=mx.float32)
    return recurrence(q, k, v, g, beta, state, mask)


def use_in_mlx_layers(model: Any) -> int:
    """Point every module of `model` that calls mlx-lm's gated_delta_update at this one (mlx-lm's
    linear attention modules import the name); returns how many modules were changed."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    changed = 0
    for module in {type(m).__module__ for m in model.modules()}:
        namespace = sys.modules.get(module)
        if getattr(namespace, "gated_delta_update", None) is mlx_gated_delta.gated_delta_update:
            namespace.gated_delta_update = gated_delta_update
            changed += 1
    return changed
