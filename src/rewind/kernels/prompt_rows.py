"""A prompt call's matrix products at row counts that repeat, for MLX's CUDA backend.

MLX's CUDA matmul asks cuBLASLt for an algorithm at every call (`CublasGemm` in
mlx/backend/cuda/gemms, 0.32, keeps no plan of its own); cuBLASLt remembers its answer per shape,
and the first call of a shape costs ~2 ms on an H100 where later ones cost nothing
(benchmarks/results/gpu/new-shapes-h100-892a32b.txt: [L, 1024] x [1024, 3584], 2.1-4.3 ms the first
time at each new L, 0.0 after). A prompt call's row count is its token count, and a cached turn's
tail is a length the process has rarely seen, so each of a model's product shapes (4 in a fused
Llama-3.2-1B, more in Qwen 3.5) paid it again: a Llama tail chunk of a new length took 18-19 ms
against 9.4 once seen, a Qwen 3.5 one 27-40 against 15.

Here a product of a prompt call (more than one position) runs with its rows padded with zeros to
a multiple of ROW_BUCKET and the padded rows' outputs dropped: the row counts are the 8 multiples
of 32 up to a 256-token chunk, whose plans the warm-up builds at load (`warm_plans`). Each real
row is the same dot product of the same inputs; which cuBLAS algorithm sums it depends on the
padded count, the same for a cold and a cached turn's call of one length. The cost: at most 31
zero rows a product, on calls bound by reading the weights.

Decode steps (one position a row) keep their shapes: one row is MLX's matrix-vector kernel, and a
batch's row count is the compiled step's own bucket (rewind.engine.compiled_decode). Metal's
matmul kernels are built per alignment class, not per shape, so this is CUDA's alone.
`REWIND_PROMPT_ROWS=off` keeps the exact row counts (read at each call).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from rewind import env

ROW_BUCKET = 32


def padded_rows(rows: int) -> int:
    """The row count a prompt call of `rows` rows computes at."""
    if rows <= 0:
        raise ValueError(f"a product has at least one row, not {rows}")
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def takes(x: mx.array) -> bool:
    """Whether a product of `x` ([batch, positions, width]) is a prompt call's this module pads."""
    return x.ndim == 3 and x.shape[1] > 1 and not env.prompt_rows_off()


def product(x: mx.array, weight: mx.array) -> mx.array:
    """x [batch, positions, K] @ weight^T (weight [N, K]) computed at `padded_rows` rows:
    [batch, positions, N]."""
    if x.ndim != 3 or weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {x.shape} does not fit weight {weight.shape}")
    batch, positions, width = x.shape
    rows = batch * positions
    flat = x.reshape(rows, width)
    padded = padded_rows(rows)
    if padded > rows:
        flat = mx.concatenate([flat, mx.zeros((padded - rows, width), x.dtype)])
    out = flat @ weight.T
    if padded > rows:
        out = out[:rows]
    return out.reshape(batch, positions, weight.shape[0])


def warm_plans(weights: list[mx.array], most_rows: int) -> int:
    """Run each distinct weight shape's product at every padded row count up to `most_rows` (a
    prompt call's largest: the chunk size), so cuBLASLt has chosen their algorithms before a
    request waits on one. Returns the products run."""
    one_of_each: dict[tuple[Any, ...], mx.array] = {}
    for weight in weights:
        if weight.ndim == 2:
            one_of_each.setdefault((tuple(weight.shape), weight.dtype), weight)
    calls = 0
    for weight in one_of_each.values():
        for rows in range(ROW_BUCKET, padded_rows(most_rows) + 1, ROW_BUCKET):
            mx.eval(product(mx.zeros((1, rows, weight.shape[1]), weight.dtype), weight))
            calls += 1
    return calls


def padded_in(model: Any) -> bool:
    """Whether `model`'s prompt calls pad their products here (its fingerprint says so: the
    padded products may round otherwise than exact ones)."""
    from rewind.kernels.cuda_rows import RowsLinear

    return not env.prompt_rows_off() and any(
        type(module) is RowsLinear for _, module in model.named_modules())
