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

The kernel: a block takes 16 x w_tiles output columns (mma A tiles of W's rows) for every row
of x (MT tiles of 8), and its warps split K between them, 32 elements a step: each lane loads 16
bytes of two W rows a tile and of each x row (the mma's k positions are a permutation of those
32, the same for W and x, so the sum is the product's), and the warps' partial sums meet in
shared memory in warp order. Where W has few rows for its K, K is also split over `split`
blocks, whose float sums a second kernel adds in block order. Each weight is read once for all
rows. A row of x is one column of each tensor-core product and its sums run in a fixed order, so
a row's result depends on that row alone, not on the other rows or their count (no atomics, no
split by batch size). The bits differ from cuBLAS's (another summation order), as cuBLAS's
differ between its own algorithms. `tiling_for` picks the split by the product's size.

The sizes reach the kernel by value (MLX passes an input's shape as a kernel parameter), not as
a small array the host writes each call: MLX allocates such an array in managed memory, and the
kernel's first read of it waits for the page to move to the GPU (under Nsight Compute ~0.1-0.2
ms a call, against under 0.05 ms for the whole product with the sizes by value;
remote-ab-h100-*.md in benchmarks/results/gpu/).

Opt-in (REWIND_SKINNY_PRODUCTS=on; the default keeps cuBLAS). Measured on an H100, Llama-3.2-1B
shape, 32 rows (benchmarks/results/gpu/*skinny*-h100-*, docs/HARDWARE.md): a step's 65 products
took 1.34 ms of GPU time against cuBLAS's 1.17 (Nsight Compute; 2.01 with the first tiling),
and a 32-stream step's GPU busy 2.69 against 2.61 ms with 1.2 against 1.8 ms of CUDA API host
time; served side by side in one process the two engines were within the run's noise (6,092
against 6,254 tokens/s). It stays for what else it gives: rows that compute alone in a batch
(tested on the GPU), which exact speculation inside a GPU batch needs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import mlx.core as mx

from rewind.kernels.cuda_device import on_cuda

log = logging.getLogger(__name__)

# the decode batches of up to 32 rows; more go to cuBLAS. Of the tilings measured, the best at
# 64 rows took 1.6-2.1x cuBLAS's GPU time a product, at 32 rows 1.1-1.4x (skinny-tilings-h100-*)
MAX_ROWS = 32
WARPS = 8  # warps a block, splitting K
K_STEP = 32  # K elements a warp takes a step (a 16-byte load per lane per row)
UNROLL = 4  # steps a warp loads before it multiplies (bytes in flight for HBM)
# Tiles of 16 W rows a block takes: each x value a warp loads serves them all (x is read from
# L2 once per block, and there are n / (16 * W_TILES) blocks).
W_TILES = 1

_SOURCE = """
    const int lane = threadIdx.x;
    const int warp_id = threadIdx.y;
    // sizes by value (MLX passes an input's shape as a kernel parameter where the source names
    // it), not read from a small array the host wrote: MLX keeps those in managed memory, and
    // a kernel reading one waits on the host's page
    const int rows = x_shape[0];
    const int n = w_shape[0];
    const int k = w_shape[1];
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
    // SPLIT blocks share a tile's K (blockIdx.y the part): steps [begin, steps) of 32 values
    const int per_part = (k / 32 + SPLIT - 1) / SPLIT;
    const int begin = blockIdx.y * per_part;
    const int steps = min(k / 32, begin + per_part);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int s0 = begin + warp_id * UNROLL; s0 < steps; s0 += WARPS * UNROLL) {
      uint4 a[UNROLL][NT][2];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            a[u][j][h] = s0 + u < steps ? load_w<STREAM_W>(w_rows[j][h] + (s0 + u) * 4) : zero;
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
        // one part of SPLIT: its float sums, for _JOIN_SOURCE to add in part order
        if (row < rows && column < n)
          out[((size_t)blockIdx.y * rows + row) * n + column] = static_cast<OutT>(total);
      }
    }
"""

_JOIN_SOURCE = """
    // out[row, column] = the SPLIT parts' sums added in part order (a row's own values only)
    const size_t index = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t count = (size_t)parts_shape[1] * parts_shape[2];
    if (index >= count) return;
    float total = 0.0f;
#pragma unroll
    for (int part = 0; part < SPLIT; ++part) total += parts[part * count + index];
    out[index] = static_cast<InT>(total);
"""

_HEADER = """
// W's loads: through L1 (0) or streamed past it (1, ld.global.cs), which leaves L1 to x's rows
template <int STREAM>
__device__ __forceinline__ uint4 load_w(const uint4* at) {
  if constexpr (STREAM == 1) {
    return __ldcs(at);
  } else {
    return *at;
  }
}
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
        input_names=["x", "w"], output_names=["out"],
        source=f"#define MMA {macro}\n" + _SOURCE + "#undef MMA\n", header=_HEADER)


@functools.lru_cache(maxsize=None)
def _join_kernel() -> Any:
    return mx.fast.cuda_kernel(name="rewind_skinny_join", input_names=["parts"],
                               output_names=["out"], source=_JOIN_SOURCE)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How `matmul`'s kernel splits a product: `w_tiles` tiles of 16 W rows a block, `warps`
    warps a block splitting K, `unroll` steps of 32 a warp loads before it multiplies, K split
    over `split` blocks (whose float sums a second kernel adds in order), and W's loads
    streamed past L1 (`stream_w`)."""

    w_tiles: int = W_TILES
    warps: int = WARPS
    unroll: int = UNROLL
    split: int = 1
    stream_w: bool = False


def tiling_for(rows: int, n: int, k: int) -> Tiling:
    """The tiling `matmul` uses for `rows` rows against W [n, k]: the fastest measured on an
    H100 for each of a Llama-3.2-1B step's products (benchmarks/probes/skinny_tilings.py,
    Nsight Compute, benchmarks/results/gpu/skinny-tilings-h100-*), as a rule by size.

    - K split over blocks where W has few rows for its K (the down projection, K = 4 N, whose
      2048 rows make 64-128 blocks for the H100's 132 multiprocessors otherwise): 4 parts, 8 up
      to 8 rows.
    - Up to 8 rows: 16 warps a block of 16 W rows, or 4 tiles a block for a wide W (the MLP's
      gate/up, the head) or a split K.
    - 9 to 32 rows: 2 tiles a block (each x value a warp loads serves 32 W rows), 2 steps loaded
      ahead.
    Which resource each choice relieves was not measured, only the time."""
    t = tiles(rows)
    parts = (8 if t == 1 else 4) if k >= 4 * n else 1
    if t == 1:
        if parts > 1 or n >= 8192:
            return Tiling(w_tiles=4, warps=8, unroll=2, split=parts)
        return Tiling(w_tiles=1, warps=16, unroll=2)
    return Tiling(w_tiles=2, warps=8, unroll=2, split=parts)


def fits(tiling: Tiling, rows: int) -> bool:
    """Whether the warps' partial sums of `tiling` for `rows` rows fit a block's 48 KB of static
    shared memory (a float a lane, WARPS x tiles-of-8-rows x 4 of them)."""
    return tiling.warps * tiles(rows) * 4 * 32 * 4 <= 48 * 1024


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


def matmul(x: mx.array, weight: mx.array, tiling: Tiling | None = None) -> mx.array:
    """x [..., K] @ weight^T for weight [N, K]: [..., N], split as `tiling` says (by default
    `tiling_for`'s). Raises ValueError for what the kernel does not take (see `takes`)."""
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {x.shape} does not fit weight {weight.shape}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if not takes(rows, weight, x.dtype):
        raise ValueError(f"{rows} rows of {x.dtype} against {weight.dtype} {weight.shape}: the "
                         f"kernel takes 2 to {MAX_ROWS} rows of bf16 or fp16, K a multiple of "
                         f"{K_STEP}, one dtype")
    n, k = weight.shape
    tiling = tiling or tiling_for(rows, n, k)
    if not fits(tiling, rows):
        raise ValueError(f"{tiling} for {rows} rows: the warps' sums outgrow a block's static "
                         f"shared memory (48 KB)")
    split = tiling.split
    out = _kernel(x.dtype == mx.float16)(
        inputs=[x.reshape(rows, k), weight],
        template=[("InT", x.dtype), ("OutT", x.dtype if split == 1 else mx.float32),
                  ("MT", tiles(rows)), ("NT", tiling.w_tiles), ("WARPS", tiling.warps),
                  ("UNROLL", tiling.unroll), ("SPLIT", split),
                  ("STREAM_W", int(tiling.stream_w))],
        grid=(32 * -(-n // (16 * tiling.w_tiles)), tiling.warps * split, 1),
        threadgroup=(32, tiling.warps, 1), output_shapes=[(split, rows, n)],
        output_dtypes=[x.dtype if split == 1 else mx.float32])[0]
    if split > 1:
        out = _join_kernel()(
            inputs=[out], template=[("InT", x.dtype), ("SPLIT", split)],
            grid=(rows * n, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(rows, n)],
            output_dtypes=[x.dtype])[0]
    return out.reshape(*lead, n)


def wanted() -> bool:
    """REWIND_SKINNY_PRODUCTS=on with CUDA (auto keeps cuBLAS: see the module docstring)."""
    from rewind import env

    return env.skinny_products() == "on" and available()


# Row counts whose variants `agrees_with_mlx` builds and checks: one per tile count (1, 2, 4).
CHECK_ROWS = (3, 9, 17)


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
