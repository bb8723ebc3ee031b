"""nn.Linear layers whose products run in Rewind's C matrix kernel, reading bf16 weights in place.

The families the native forward pass does not implement (Gemma 4, Qwen 3.5's hybrid layers,
Ministral 3, Qwen-VL with 3-D positions, and any other mlx-lm family) run MLX's own layers on
the CPU. MLX's CPU bf16 matmul is ~10x slower than float32 through BLAS, so those models used to
be widened to float32: twice the bytes to hold, and twice the bytes to read for every decoded
token. `use_in_model` swaps each bf16 `nn.Linear` for a `NativeLinear` that keeps the stored
bf16 weight and computes x @ W^T (+ b) in cpu_kernels.c's `matvec`, which widens in registers
and accumulates in float32 (~220 GFLOP/s on a 512-row chunk here, as fast as OpenBLAS on float32;
a decode step reads the weight once). The answer is the float32 computation's, up to summation
order. Everything else in the model (norms, convolutions, embeddings, caches) stays MLX's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from rewind.kernels import boundary, native
from rewind.kernels.boundary import MatrixArgs


class NativeLinear(nn.Module):
    """y = x @ W^T + b with W kept as stored (bf16) and read by the C kernel; float32 out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight
        mx.eval(weight)
        # Outside the parameter tree (a leading underscore): the loader's float32 widening and
        # dtype casts must leave the stored weight alone.
        self._weight = weight
        host = np.asarray(weight.view(mx.uint16))  # no copy: the kernel reads it in place
        self._matrix = MatrixArgs.build(np.ascontiguousarray(host), native.FORM_BF16)
        self._bias = (np.array(linear.bias.astype(mx.float32)) if "bias" in linear else None)
        self.out_features, self.in_features = (int(n) for n in weight.shape)

    def _fallback(self, x: mx.array) -> mx.array:
        out = x.astype(mx.float32) @ self._weight.astype(mx.float32).T
        return out if self._bias is None else out + mx.array(self._bias)

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        rows = int(np.prod(lead)) if lead else 1
        try:
            flat = x.reshape(rows, self.in_features).astype(mx.float32)
            mx.eval(flat)
        except (RuntimeError, ValueError):  # inside mx.compile, where nothing may be evaluated
            return self._fallback(x)
        host_x = np.asarray(flat)
        if not host_x.flags.c_contiguous:
            host_x = np.ascontiguousarray(host_x)
        out = np.empty((rows, self.out_features), np.float32)
        boundary.kernels().matvec(self._matrix, host_x, out, native.kernel_threads())
        if self._bias is not None:
            out += self._bias
        return mx.array(out).reshape(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        return self._matrix.nbytes


def use_in_model(model: Any) -> int:
    """Replace every bf16 `nn.Linear` of `model` (not quantized ones, not other classes, not the
    output head, which rewind.kernels.fast_head handles) with a NativeLinear; returns how many.
    Does nothing where the kernels cannot be built."""
    if native.load_kernels() is None:
        return 0
    swaps: list[tuple[Any, Any, Any]] = []
    for _, module in model.named_modules():
        for name, child in module.children().items():
            if name == "lm_head":
                continue
            if type(child) is nn.Linear and child.weight.dtype == mx.bfloat16:
                swaps.append((module, name, child))
            elif isinstance(child, list):
                swaps += [(child, index, item) for index, item in enumerate(child)
                          if type(item) is nn.Linear and item.weight.dtype == mx.bfloat16]
    for owner, name, linear in swaps:
        owner[name] = NativeLinear(linear)
    return len(swaps)


def native_linear_bytes(model: Any) -> int:
    return sum(m.nbytes for _, m in model.named_modules() if isinstance(m, NativeLinear))


def rows_compute_alone(model: Any) -> bool:
    """Whether each position of a call through `model`'s MLX layers on the CPU computes the same
    bits whatever else the call holds (more positions, other batch rows): its matrix products
    run in the C kernel, which computes each row alone (MLX's float32 matmul goes to OpenBLAS,
    whose gemm sums in another order than its gemv); attention in Rewind's C kernel, which visits
    a row's keys by position (rewind.kernels.cpu_attention); linear attention's recurrence in its
    C kernel, one position after another. Norms, convolutions and lookups are per position. The
    output head is the runner's to compute one position at a time. Speculative decoding checks a
    draft in one call of several positions, so it keeps the answer only where this holds."""
    from rewind import env

    if mx.default_device() != mx.cpu or native.load_kernels() is None:
        return False
    if env.cpu_attention_off() or env.gated_delta_off():
        return False
    per_position = (NativeLinear, nn.Embedding, nn.Conv1d, nn.RMSNorm, nn.LayerNorm)
    for name, module in model.named_modules():
        if name.split(".")[-1] == "lm_head" or isinstance(module, per_position):
            continue
        weight = module.get("weight") if isinstance(module, dict) else None
        if isinstance(weight, mx.array) and weight.ndim >= 2 \
                and type(module).__name__ not in _PER_POSITION_NAMES:
            return False
    return True


# Modules of mlx-lm and Rewind with a 2-D weight that compute each position alone: embedding
# tables read in place, and the norms of families that define their own.
_PER_POSITION_NAMES = frozenset({"StoredEmbedding", "InPlaceEmbedding", "ScaledEmbedding"})
