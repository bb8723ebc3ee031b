"""A linear layer's rows of every sequence through one matrix product, on GPUs.

A decode step's activations are [B, 1, H]: B sequences of one token each. MLX's CUDA matmul
takes [B, 1, K] @ [K, N] as B products of one row and runs its matrix-vector kernel on each
(`gemv_batched`: `can_use_gemv` takes M == 1, mlx/backend/cuda/gemms/gemv.cu), reading the
weights once per sequence. Folded to [1, B, K], the same rows are one product through cuBLAS,
which reads the weights once. On an H100 (Llama-3.2-1B shape, random bf16 weights, 32 streams)
`gemv_batched` took 4.37 ms of a decode step's 7.03 ms of GPU time
(benchmarks/results/gpu/decode-kernels-h100-8cf6545.md).

The fold is a reshape of contiguous rows (no copy). The price: a row's result now depends on
how many rows share the step (a GEMM sums in another order than a matrix-vector kernel, and
cuBLAS picks its algorithm by shape), where MLX's per-row products gave each row the same bits
at any batch size. MLX's attention on a GPU already did not (mixed-length batches take its
unfused path, a lone row cuDNN's), so a greedy answer on a GPU could already differ with the
load; the prompt cache's equivalence (a restored prompt answers as a cold one in the same
batch) is unchanged. `REWIND_FOLD_LINEAR=off` keeps MLX's way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from rewind.kernels.rebind import register_stand_in


_folding = True  # False inside stepped_aside()


@contextmanager
def stepped_aside() -> Iterator[None]:
    """Every FoldedLinear computes as nn.Linear does, inside (benches: mlx-lm as shipped, and
    the layer's own effect measured in one process)."""
    global _folding
    before, _folding = _folding, False
    try:
        yield
    finally:
        _folding = before


class FoldedLinear(nn.Linear):
    """An `nn.Linear` whose [B, L, K] inputs with B > 1 go through as [1, B * L, K]."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim != 3 or x.shape[0] == 1 or not _folding:
            return super().__call__(x)
        batch, length, width = x.shape
        return super().__call__(x.reshape(1, batch * length, width)).reshape(batch, length, -1)


register_stand_in(FoldedLinear, nn.Linear)


def use_in_model(model: Any) -> int:
    """Every plain `nn.Linear` of `model` (quantized ones keep their class) folds its batch;
    returns how many."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = FoldedLinear
            changed += 1
    return changed
