"""Whether MLX computes on its CUDA backend here: the condition every CUDA kernel module and
CUDA-only default of Rewind checks."""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    """MLX's default device is a GPU of its CUDA backend (not Metal, not the CPU)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()
