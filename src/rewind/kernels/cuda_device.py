"""Whether MLX computes on its CUDA backend here (the condition every CUDA kernel module and
CUDA-only default of Rewind checks), and the constants Rewind's CUDA kernels read."""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    """MLX's default device is a GPU of its CUDA backend (not Metal, not the CPU)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


_CONSTANTS: dict[tuple[float, ...], mx.array] = {}


def constant_floats(*values: float) -> mx.array:
    """`values` as one float32 array that a kernel reads on the GPU, one array per distinct
    values (a RoPE's [scale, log2(base)], an RMSNorm's eps, an attention's scale): a compiled
    step captures it once, and an uncompiled one does not upload it every layer and step.

    Padded to at least 16 bytes: MLX's CUDA allocator keeps arrays of 8 bytes or less in a pool
    of managed memory that stays on the host (advised as accessed by the GPU, so never moved),
    and every kernel's read of one crosses the bus; a larger array moves to the GPU at its first
    read and stays there, as nothing on the host writes it again."""
    got = _CONSTANTS.get(values)
    if got is None:
        padded = list(values) + [0.0] * max(0, 4 - len(values))
        got = _CONSTANTS[values] = mx.array(padded, mx.float32)
    return got
