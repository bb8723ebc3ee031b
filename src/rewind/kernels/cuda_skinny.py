"""Matrix products of a decode batch on CUDA in one kernel of Rewind's own: x [M, K] @ W^T for
2 to MAX_ROWS rows (decode batches, and prompt chunks that short), bf16 or fp16, on tensor
cores (mma.sync m16n8k16, float accumulation).

Why: MLX's CUDA matmul sends every product of more than one row to cuBLASLt, and each call pays
on the host, every step: a matmul descriptor and layouts built anew, an algorithm heuristic
queried (`cublasLtMatmulAlgoGetHeuristic`), and the call captured into a child graph that is
added to MLX's CUDA graph and destroyed (mlx/backend/cuda/gemms/cublas_gemm.cpp,
cublas_utils.cpp). A 32-row decode step of a 1B Llama makes 65 such calls; its MLX dispatch took
3.3 ms of a 4.7 ms step on an H100 where one row's (MLX's own gemv kernel, a plain kernel node)
took 1.35 ms (decode-profile-h100-f18d634). A custom kernel is one kernel node.

The kernel: a block takes 16 x W_TILES output columns (mma A tiles of W's rows) for every row
of x (MT tiles of 8), and its WARPS warps split K between them, 32 elements a step: each lane
loads 16 bytes of two W rows a tile and of each x row (the mma's k positions are a permutation
of those 32, the same for W and x, so the sum is the product's), and the warps' partial sums
meet in shared memory in warp order. Each weight is read once for all rows. A row of x is one
column of each tensor-core product and its sums run in a fixed order, so a row's result depends
on that row alone, not on the other rows or their count (no atomics, no split by batch size).
The bits differ from cuBLAS's (another summation order), as cuBLAS's differ between its own
algorithms.

Opt-in (REWIND_SKINNY_PRODUCTS=on; the default keeps cuBLAS). Measured on an H100, Llama-3.2-1B
shape, 32 streams (benchmarks/results/gpu/*skinny*-h100-*, docs/HARDWARE.md): the step's CUDA
API host time fell from 3.2 to 1.6 ms, but these products took ~1.6x cuBLAS's GPU time (1.7
against 1.1 ms a step, 1.5 against 2.3 TB/s of weights). A step bound by the host gained (7,604
against 5,590 tokens/s, separate processes); one bound by the GPU lost (5,320-5,779 against
7,787, one process). It stays for what else it gives: rows that compute alone in a batch (tested
on the GPU), which exact speculation inside a GPU batch needs.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import mlx.core as mx

from rewind.kernels.cuda_device import on_cuda

log = logging.getLogger(__name__)

MAX_ROWS = 64  # the decode batches of up to 64 rows; more go to cuBLAS (arithmetic-bound there)
WARPS = 8  # warps a block, splitting K
K_STEP = 32  # K elements a warp takes a step (a 16-byte load per lane per row)
UNROLL = 4  # steps a warp loads before it multiplies (bytes in flight for HBM)
# Tiles of 16 W rows a block takes: each x value a warp loads serves them all (x is read from
# L2 once per block, and there are n / (16 * W_TILES) blocks).
W_TILES = 1

_SOURCE = """
    const int lane = threadIdx.x;
    const int warp_id = threadIdx.y;
    const int rows = shape[0];
    const int n = shape[1];
    const int k = shape[2];
    const int group = lane >> 2;   // the mma's groupID: a W row of a tile, an x row of a tile
    const int quad = lane & 3;     // its thread-in-group: which 16 bytes of the step's 32 values
    const int first = blockIdx.x * 16 * NT;
    // each of the block's NT tiles of 16 W rows: rows `group` and `group + 8` of it, this lane's
    // 16 bytes of each step; W rows past n (a last tile cut short) read row n - 1, not written
    const uint4* w_rows[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(first + j * 16 + group + h * 8, n - 1);
        w_rows[j][h] = reinterpret_cast<const uint4*>(w + (size_t)row * k) + quad;
      }
    }
    float acc[NT][MT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][t][i] = 0.0f;
      }
    }
    const int steps = k / 32;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int s0 = warp_id * UNROLL; s0 < steps; s0 += WARPS * UNROLL) {
      uint4 a[UNROLL][NT][2];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            a[u][j][h] = s0 + u < steps ? w_rows[j][h][(s0 + u) * 4] : zero;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int s = s0 + u;
        if (s >= steps) break;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const int row = t * 8 + group;
          const uint4 b = row < rows
              ? reinterpret_cast<const uint4*>(x + (size_t)row * k)[s * 4 + quad] : zero;
          // k positions 2q, 2q+1 | 2q+8, 2q+9 of the first mma are this lane's values 0-1 | 2-3,
          // of the second its values 4-5 | 6-7: the same places in W's and x's registers
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4 lo = a[u][j][0], hi = a[u][j][1];
            MMA(acc[j][t], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
            MMA(acc[j][t], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
          }
        }
      }
    }
    // acc[j][t][0..1]: W row j*16 + group, x rows t*8 + 2*quad + 0..1; [2..3]: W row + 8.
    // One W tile at a time through shared memory (48 KB at most, static)
    __shared__ float partial[WARPS][MT * 4][32];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (j > 0) __syncthreads();  // the last tile's sums are read
#pragma unroll
      for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp_id][t * 4 + i][lane] = acc[j][t][i];
      }
      __syncthreads();
      for (int slot = warp_id; slot < MT * 4; slot += WARPS) {
        float total = 0.0f;
#pragma unroll
        for (int w_ = 0; w_ < WARPS; ++w_) total += partial[w_][slot][lane];
        const int t = slot >> 2, i = slot & 3;
        const int row = t * 8 + 2 * quad + (i & 1);
        const int column = first + j * 16 + group + (i >> 1) * 8;
        if (row < rows && column < n) out[(size_t)row * n + column] = static_cast<InT>(total);
      }
    }
"""

_HEADER = """
#define MMA_BF16(c, a0, a1, a2, a3, b0, b1) \\
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 " \\
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \\
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \\
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
#define MMA_F16(c, a0, a1, a2, a3, b0, b1) \\
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 " \\
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};" \\
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \\
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
"""


def available() -> bool:
    return on_cuda()


@functools.lru_cache(maxsize=None)
def _kernel(half: bool) -> Any:
    macro = "MMA_F16" if half else "MMA_BF16"
    return mx.fast.cuda_kernel(
        name=f"rewind_skinny_matmul_{'f16' if half else 'bf16'}",
        input_names=["x", "w", "shape"], output_names=["out"],
        source=f"#define MMA {macro}\n" + _SOURCE + "#undef MMA\n", header=_HEADER)


def takes(rows: int, weight: mx.array, dtype: Any) -> bool:
    """Whether `matmul` takes x of `rows` rows and `dtype` against `weight` [N, K]."""
    return (2 <= rows <= MAX_ROWS and weight.ndim == 2 and weight.dtype == dtype
            and dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % K_STEP == 0)


def tiles(rows: int) -> int:
    """The kernel's tiles of 8 rows for `rows` rows: a power of two, so that few variants are
    built (a row's result is the same in each)."""
    count = 1
    while count * 8 < rows:
        count *= 2
    return count


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x [..., K] @ weight^T for weight [N, K]: [..., N]. Raises ValueError for what the kernel
    does not take (see `takes`)."""
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {x.shape} does not fit weight {weight.shape}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if not takes(rows, weight, x.dtype):
        raise ValueError(f"{rows} rows of {x.dtype} against {weight.dtype} {weight.shape}: the "
                         f"kernel takes 2 to {MAX_ROWS} rows of bf16 or fp16, K a multiple of "
                         f"{K_STEP}, one dtype")
    n, k = weight.shape
    out = _kernel(x.dtype == mx.float16)(
        inputs=[x.reshape(rows, k), weight, mx.array([rows, n, k], mx.int32)],
        template=[("InT", x.dtype), ("MT", tiles(rows)), ("NT", W_TILES), ("WARPS", WARPS),
                  ("UNROLL", UNROLL)],
        grid=(32 * -(-n // (16 * W_TILES)), WARPS, 1), threadgroup=(32, WARPS, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])[0]
    return out.reshape(*lead, n)


def wanted() -> bool:
    """REWIND_SKINNY_PRODUCTS=on with CUDA (auto keeps cuBLAS: see the module docstring)."""
    from rewind import env

    return env.skinny_products() == "on" and available()


# Row counts whose variants `agrees_with_mlx` builds and checks: one per tile count (1, 2, 4, 8).
CHECK_ROWS = (3, 9, 17, 33)


def agrees_with_mlx(weight: mx.array, tolerance: float = 2e-2) -> str | None:
    """None where `matmul` gives MLX's product for `weight`'s shape and dtype at every tile
    count, within `tolerance` of the output's largest magnitude (the products sum in other
    orders); else what differed. Builds every variant, so that no request waits for one."""
    k = weight.shape[1]
    for rows in CHECK_ROWS:
        x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(weight.dtype)
        ours = matmul(x, weight).astype(mx.float32)
        theirs = (x @ weight.T).astype(mx.float32)
        scale = mx.max(mx.abs(theirs)).item()
        worst = mx.max(mx.abs(ours - theirs)).item()
        if not worst <= tolerance * max(scale, 1e-6):
            return (f"{rows} rows of {weight.dtype} against {tuple(weight.shape)}: off by "
                    f"{worst:.4g} where the output reaches {scale:.4g}")
    return None


def use_in_model(model: Any) -> int:
    """Mark every bias-free Linear of `model` and its embedding tables (a tied output head is
    one) to take their products of 2 to MAX_ROWS rows here, once the kernel agreed with MLX's
    product on the model's first weight on this device; returns how many modules. What reads
    the mark: rewind.kernels.cuda_rows's RowsLinear (the loader makes every such Linear one
    first) and `head_of`. Off CUDA, with REWIND_SKINNY_PRODUCTS=off, or where the check fails
    (logged), nothing changes."""
    import mlx.nn as nn

    if not wanted():
        return 0
    modules = [m for _, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.Embedding)) and "bias" not in m
               and m.weight.ndim == 2 and m.weight.dtype in (mx.bfloat16, mx.float16)
               and m.weight.shape[1] % K_STEP == 0]
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    if not linears:
        return 0
    try:
        verdict = agrees_with_mlx(linears[0].weight)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build: cuBLAS stays
        verdict = f"{type(exc).__name__}: {exc}"
    if verdict is not None:
        log.warning("rewind.kernels.cuda_skinny: the batch product differs from MLX's (%s); "
                    "decode batches keep cuBLAS", verdict)
        return 0
    for module in modules:
        module.__dict__["_rewind_skinny"] = True
    return len(modules)


def head_of(head: Any) -> Any:
    """A model's tied output head (an embedding's `as_linear`, rewind.kernels.model_split) as
    this kernel's product for 2 to MAX_ROWS rows where `use_in_model` marked the embedding;
    None otherwise (a RowsLinear head is marked itself)."""
    import mlx.nn as nn

    owner = getattr(head, "__self__", None)
    if not (type(owner) is nn.Embedding and getattr(head, "__name__", "") == "as_linear"
            and "_rewind_skinny" in owner.__dict__):
        return None
    weight = owner.weight

    def product(hidden: mx.array) -> mx.array:
        if takes(hidden.size // hidden.shape[-1], weight, hidden.dtype):
            return matmul(hidden, weight)
        return head(hidden)

    return product


def takes_module(module: Any, rows: int, dtype: Any) -> bool:
    """Whether a RowsLinear marked by `use_in_model` takes a product of `rows` rows here."""
    return "_rewind_skinny" in module.__dict__ and takes(rows, module.weight, dtype)
