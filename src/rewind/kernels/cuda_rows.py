"""Matrix products whose rows compute alone on CUDA: x [P, K] @ W^T for a few rows P, each row
summed exactly as MLX's one-row product sums it (mx.fast.cuda_kernel).

Why: speculative decoding checks a drafted row's k tokens in one call of k + 1 positions, and
keeps them only if each position's logits are the bits a one-token step computes. MLX's CUDA
matmul takes its matrix-vector kernel (`gemv`, mlx/backend/cuda/gemms/gemv.cu) for one row and a
cuBLAS algorithm chosen per shape for more, which sums in another order. This kernel is MLX's
gemv with the rows of x as an inner loop: a warp takes one output column, each lane sums its
slices of K in gemv's order (N_PER elements at a time, a warp's stride apart, one fused
multiply-add each, in float), and the warp's sums meet in the same cooperative-groups reduction.
So each row's output is the one-row product's bits, and each weight is read once for all the
rows of a group (GROUP_ROWS; P up to 17 reads them three times at most).

Where the bits come from: gemv_impl in MLX 0.32's gemv.cu (n_per_thread 4 when K % 128 == 0, 2
when K % 64 == 0, else 1, for aligned buffers; accumulation in float for bf16/fp16; cg::reduce
with cg::plus). Both MLX's build and NVRTC contract `sum += a * b` into one fused multiply-add
(neither passes fast-math flags). `same_as_mlx` checks it for a model's own weights on the
device it runs on when the model loads into an engine (rewind.engine.runner), and the tests and
benchmarks/probes/row_alone.py compare against MLX to the bit; if an MLX release sums another
way the check fails and the model's rows do not draft.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from rewind.kernels import cuda_skinny
from rewind.kernels.cuda_device import on_cuda

log = logging.getLogger(__name__)

# Rows summed per pass over the weights: each lane holds a float sum per row and the slice of
# W it loaded once for them all.
GROUP_ROWS = 8
ROWS_PER_BLOCK = 8  # warps per block, one output column each (gemv's rows_per_block)
MAX_ROWS = 64  # calls with more rows go to MLX (cuBLAS): the kernel would read W too often

_SOURCE = """
    constexpr int WARP = 32;
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<WARP>(block);
    const int lane = warp.thread_rank();
    const int column = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    const int group = blockIdx.y;
    // sizes by value (rewind.kernels.cuda_skinny says why not from an array the host wrote)
    const int rows = x_shape[0];
    const int n = w_shape[0];
    const int k = w_shape[1];
    if (column >= n) return;
    const int first = group * GROUP_ROWS;
    const InT* w_row = w + (size_t)column * k;
    float sum[GROUP_ROWS];
#pragma unroll
    for (int r = 0; r < GROUP_ROWS; ++r) sum[r] = 0.0f;
    for (int col = N_PER * lane; col < k; col += WARP * N_PER) {
      InT wv[N_PER];
#pragma unroll
      for (int j = 0; j < N_PER; ++j) wv[j] = w_row[col + j];
#pragma unroll
      for (int r = 0; r < GROUP_ROWS; ++r) {
        if (first + r < rows) {
          const InT* x_row = x + (size_t)(first + r) * k + col;
#pragma unroll
          for (int j = 0; j < N_PER; ++j) {
            sum[r] += static_cast<float>(wv[j]) * static_cast<float>(x_row[j]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < GROUP_ROWS; ++r) {
      if (first + r < rows) {
        const float total = cg::reduce(warp, sum[r], cg::plus<float>());
        if (lane == 0) out[(size_t)(first + r) * n + column] = static_cast<InT>(total);
      }
    }
"""


def available() -> bool:
    return on_cuda()


def elements_per_lane(k: int) -> int:
    """gemv's n_per_thread for aligned buffers (MLX arrays are)."""
    return 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    # MLX's kernel header includes cooperative_groups.h, not the reduction's own header
    return mx.fast.cuda_kernel(name="rewind_rows_alone_matmul", input_names=["x", "w"],
                               output_names=["out"], source=_SOURCE,
                               header="#include <cooperative_groups/reduce.h>\n")


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., K] @ weight^T for weight [N, K]: [..., N], each row of x alone (see module
    docstring). Raises ValueError for what the kernel does not take: another dtype than bf16 or
    fp16, x and weight of different dtypes, more than MAX_ROWS rows."""
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {x.shape} does not fit weight {weight.shape}")
    if x.dtype != weight.dtype or x.dtype not in (mx.bfloat16, mx.float16):
        raise ValueError(f"bf16 or fp16 x and weight of one dtype, not {x.dtype} / {weight.dtype}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{rows} rows: 1 to {MAX_ROWS}")
    n, k = weight.shape
    flat = x.reshape(rows, k)
    groups = -(-rows // GROUP_ROWS)
    out = _kernel()(
        inputs=[flat, weight],
        template=[("InT", x.dtype), ("N_PER", elements_per_lane(k)),
                  ("GROUP_ROWS", GROUP_ROWS), ("ROWS_PER_BLOCK", ROWS_PER_BLOCK)],
        grid=(32 * -(-n // ROWS_PER_BLOCK), ROWS_PER_BLOCK * groups, 1),
        threadgroup=(32, ROWS_PER_BLOCK, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]
    return out.reshape(*lead, n)


# ---- which calls take it -----------------------------------------------------------------------

_local = threading.local()


@contextlib.contextmanager
def rows_alone() -> Iterator[None]:
    """Inside: this thread's RowsLinear layers with 2 to MAX_ROWS rows, and batch-1 attention
    calls of up to MAX_ROWS positions, compute each position alone (a drafted row's check).
    Outside, those calls stay MLX's, whose cuBLAS products a decode batch's rows share."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def rows_alone_on() -> bool:
    return getattr(_local, "on", False)


def missed(what: str) -> None:
    """A call inside `rows_alone` that the kernels could not take (MLX computes it, and the
    positions' bits may differ from one-token steps'): said once per kind in the log."""
    if what not in _MISSED:
        _MISSED.add(what)
        log.warning("a drafted row's check ran %s through MLX, not position by position: its "
                    "logits may differ from one-token steps' in the last bits", what)


_MISSED: set[str] = set()


class RowsLinear(nn.Linear):
    """nn.Linear (no bias) whose calls of several rows inside `rows_alone` run this module's
    kernel: each row the bits of MLX's one-row product. Its other calls are nn.Linear's, or
    rewind.kernels.cuda_skinny's where that marked the module."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        rows = x.size // x.shape[-1] if x.ndim >= 2 else 1
        if rows > 1 and rows_alone_on():
            if x.dtype == weight.dtype and rows <= MAX_ROWS:
                return matmul(x, weight)
            missed(f"a product of {rows} rows of {x.dtype}")
        elif rows > 1 and cuda_skinny.takes_module(self, rows, x.dtype):
            # REWIND_SKINNY_PRODUCTS=on: one kernel node, not a cuBLAS call (cuda_skinny)
            return cuda_skinny.matmul(x, weight)
        return x @ weight.T


def same_as_mlx(weights: list[mx.array], rows: int = 3) -> bool:
    """Whether `matmul` gives each row MLX's one-row product's bits for weights of these shapes
    and dtypes (one check per distinct shape, random rows)."""
    if not available():
        return False
    seen: set[tuple[Any, ...]] = set()
    for weight in weights:
        key = (tuple(weight.shape), weight.dtype)
        if key in seen:
            continue
        seen.add(key)
        n, k = weight.shape
        x = mx.random.normal((1, rows, k), key=mx.random.key(len(seen))).astype(weight.dtype)
        ours = matmul(x, weight)
        one_by_one = mx.concatenate([x[:, p:p + 1, :] @ weight.T for p in range(rows)], axis=1)
        if not mx.array_equal(ours, one_by_one).item():
            log.warning("rewind.kernels.cuda_rows: a product of %dx%d %s differs from MLX's "
                        "one-row product; rows will not draft on this GPU", n, k, weight.dtype)
            return False
    return True


def takes_linear(module: Any) -> bool:
    """A bias-free nn.Linear of bf16 or fp16 weights (MLX adds a bias in cuBLAS's epilogue,
    for one row as well: no gemv to match)."""
    return (type(module) in (nn.Linear, RowsLinear) and "bias" not in module
            and module.weight.ndim == 2 and module.weight.dtype in (mx.bfloat16, mx.float16))


def use_in_model(model: Any) -> int:
    """Make every bias-free bf16/fp16 nn.Linear of `model` a RowsLinear, in place (the same
    object: references held elsewhere, such as fused projections' shared product, see the
    change); returns how many. The class changes, nothing else: outside `rows_alone` they
    compute as before."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear and takes_linear(module):
            module.__class__ = RowsLinear
            count += 1
    return count


# Modules with a 2-D weight that compute each position alone: lookups and norms.
_PER_POSITION = (nn.Embedding, nn.RMSNorm, nn.LayerNorm)
_PER_POSITION_NAMES = frozenset({"StoredEmbedding", "InPlaceEmbedding", "ScaledEmbedding"})


def layers_compute_rows_alone(model: Any, heads_taken: Callable[[int, int, int], bool]) -> bool:
    """Whether, on CUDA, each position of a call through `model`'s layers inside `rows_alone`
    gets the bits of a one-token call: every product a RowsLinear (the output head is the
    runner's), every attention module's heads (query heads, key-value heads, head size) a shape
    the decode kernel takes (`heads_taken`: rewind.kernels.cuda_attention.kernel_takes_heads,
    handed in, since that module routes calls by this one's context). The caller checks the
    caches (one row's keys, no window: rewind.engine.runner)."""
    from rewind import env

    if not available() or env.cuda_attention_off():
        return False
    attention = 0
    for name, module in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            continue
        heads, kv_heads = getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
        if isinstance(heads, int) and isinstance(kv_heads, int):
            dim = getattr(module, "head_dim", None)
            if not (isinstance(dim, int) and kv_heads > 0 and heads % kv_heads == 0
                    and heads_taken(heads, kv_heads, dim)):
                return False
            attention += 1
        if type(module) is RowsLinear or isinstance(module, _PER_POSITION) \
                or type(module).__name__ in _PER_POSITION_NAMES:
            continue
        weight = module.get("weight") if isinstance(module, dict) else None
        if isinstance(weight, mx.array) and weight.ndim >= 2:
            return False
    return attention > 0


def head_of(head: Any) -> Any:
    """A model's output head (rewind.kernels.model_split: a Linear, or a tied embedding's
    `as_linear`) as this module's product, or None where it is another kind (quantized): each
    position of a drafted row's check then gets a one-row call's logits with the head's weight
    read once for eight positions, not once a position."""
    if not available():
        return None
    owner = getattr(head, "__self__", None)
    if type(owner) is nn.Embedding and getattr(head, "__name__", "") == "as_linear":
        weight = owner.weight
    elif type(head) is RowsLinear:
        weight = head.weight
    else:
        return None
    if weight.ndim != 2 or weight.dtype not in (mx.bfloat16, mx.float16):
        return None

    def head(hidden: mx.array) -> mx.array:
        if hidden.dtype == weight.dtype and hidden.size // hidden.shape[-1] <= MAX_ROWS:
            return matmul(hidden, weight)
        missed(f"the head over {hidden.size // hidden.shape[-1]} rows of {hidden.dtype}")
        return hidden @ weight.T

    return head


def weights_of(model: Any, head: Any) -> list[mx.array]:
    """The weights `rows_alone` products read: every RowsLinear's and the head's."""
    weights = [m.weight for _, m in model.named_modules() if type(m) is RowsLinear]
    owner = getattr(head, "__self__", None)
    if type(owner) is nn.Embedding:
        weights.append(owner.weight)
    return weights
