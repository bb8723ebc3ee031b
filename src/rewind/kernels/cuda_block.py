"""A decoder block's decode step for one row on CUDA in fewer kernels, with the same bits
(mx.fast.cuda_kernel).

Why: on a GPU a small model's decode step is bound by the host, and MLX's host cost is paid per
kernel (~5 us each to walk, encode and launch on an H100's host: 1.35 ms of a one-stream
Llama-3.2-1B step of ~280 kernels, whose GPU work is 1.6 ms; docs/HARDWARE.md). One row's Llama
layer runs 15: two norms, four products, two RoPEs, two key/value writes, the attention's two
kernels, two residual adds and the MLP's gate. Here a product's kernel also does what comes
before or after it elementwise:

- the q/k/v product and RoPE on the query and key heads after it (a warp takes a pair of a
  head's columns, i and i + head_dim / 2, so it holds both halves RoPE rotates together);
- the output projection and the residual add; the down projection and the residual add;
- the gate/up product and the MLP's gate after it (silu(gate) * up; a warp takes gate column j
  and up column j).

Ten kernels a Llama layer instead of fifteen; the norms, the key/value writes and the
attention (rewind.kernels.cuda_attention) stay as they were (FUSE_NORMS below computes the
norms inside the products too, measured slower). Blocks of the same form whose attention is not
a Llama one (Qwen 2 and 3, Qwen 3.5's linear and full attention layers, a Llama with biased
projections) can keep mlx-lm's attention call and fuse their MLP half: the gate/up product and
the gate, the down product and the residual add in two kernels instead of four (FUSE_MLP_HALVES,
off: not measured to pay).

Measured on an H100 (benchmarks/probes/decode_profile.py, one stream, random bf16 weights,
benchmarks/results/gpu/decode-profile-*-h100-blocks-*-bbb5289): a Llama-3.2-1B step 198
kernels instead of 290, 2.88 ms against 3.52 with mlx-lm's blocks (348 against 284 tokens/s;
each a process of its own on one machine), but its GPU work 2.05 ms against 1.65: a warp here
takes two weight rows, so the q/k/v product runs half as many warps as MLX's gemv, and waits on
memory (30 us a layer for 12.6 MB). On a host fast enough to keep up with the GPU that costs
more than it saves. One row a warp, the pairs meeting in shared memory (branch
cuda-block-one-row-a-warp, the same bits), left it at 34 us and the step's GPU work at 2.13 ms,
where the gate/up kernel of the same loop moves 67 MB in 24 us: the q/k/v kernel's time is not
its warp count (docs/HARDWARE.md).

Bits: each product column is MLX's one-row product (gemv in mlx/backend/cuda/gemms/gemv.cu:
each lane sums its N_PER-element slices of K a warp's stride apart, one fused multiply-add each
in float, then the warp's cooperative-groups reduction; rewind.kernels.cuda_rows has the same
loop), rounded to the weights' dtype as MLX stores it; what follows and precedes repeats MLX's
own code on those values: rms_norm_small's (mlx/backend/cuda/rms_norm.cu), rope_single's float
arithmetic (rope.cu), and the `Add`, `Sigmoid` and `Multiply` operators of MLX's device
headers, which its fused elementwise kernels call. So a block gives the plain layer's output
and cache writes bit for bit; a model's blocks of one kind are switched over only after the
first of them did, on the model's own weights, when it loads (`use_in_model`), and otherwise
keep mlx-lm's call. A drafted row's check (speculation) and the compiled step's bits are
therefore unchanged.

What it takes: one of mlx-lm's blocks `r = attention(input_layernorm(x)); h = x + r; out = h +
mlp(post_attention_layernorm(h))` (llama, qwen2, qwen3, qwen3_5; no sliding window) whose MLP is
`down(swiglu(gate(x), up(x)))` with gate/up run fused (rewind.models.fused_projections) over
bf16/fp16 weights without a bias, the down projection likewise, RMSNorm norms; for the attention
half also a Llama attention with fused q/k/v, no bias, and RoPE over the whole head (nn.RoPE or
mlx-lm's Llama3RoPE, not traditional). A call of one row and one token with a cache; anything
else (a batch, a prompt chunk, a drafted row's check) is mlx-lm's call. On CUDA only: Metal's
kernels would be another source, and its per-kernel cost was not measured.

REWIND_FUSED_DECODE: auto (the default) on CUDA, off, on (the same as auto: the kernels exist
for CUDA only). Read when a step's graph is built, so a compiled step (rewind.engine.
compiled_decode) keeps the setting it was traced with.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from rewind import env
from rewind.kernels import cuda_rows
from rewind.kernels.cuda_device import constant_floats, on_cuda

log = logging.getLogger(__name__)

WARPS = 8  # warps a block (gemv's rows_per_block): each takes one unit of columns
# The norms before the q/k/v and gate/up products computed inside them (each warp repeats the
# normalizer's reduction in rms_norm_small's order): eight kernels a Llama layer instead of ten,
# the same bits. Off: measured on an H100 (decode_profile.py, Llama-3.2-1B shape, one stream),
# the step's GPU work grew from 2.05 to 2.54 ms (every warp's pass over the row before its own
# columns) for the same wall time a step (2.87 ms against 2.88; 3.52 with mlx-lm's blocks).
FUSE_NORMS = False
# Blocks whose attention is not fused (Qwen 2/3, Qwen 3.5's layers) fusing their MLP half. Off:
# on an H100 (Qwen 3.5 0.8B shape, one stream, with FUSE_NORMS) 500 kernels a step instead of
# 610 moved MLX's dispatch of a step no measurable amount (5.14 ms against 5.06, processes of
# their own) while the GPU's work grew (2.19 ms against 1.97). Probes and tests set it True.
FUSE_MLP_HALVES = False

# MLX's custom kernels are compiled inside `namespace mlx::core::cu` after this header, which
# brings the device operators MLX's own fused elementwise kernels are built from.
_HEADER = """
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
#include <cooperative_groups/reduce.h>

namespace mlx::core::cu {

// COLS dot products of one activation row x with weight rows w[c], each lane summing its
// N_PER-element slices of K a warp's stride apart in MLX's gemv order (gemv_impl: one fused
// multiply-add an element, weight times activation, in float), then the warp's reduction.
// With NORM, x is the residual stream and each element is first normalized as MLX's
// rms_norm_small writes it: norm_w[e] * T(float(x[e]) * normalizer).
template <typename T, int K, int N_PER, int COLS, bool NORM, typename Warp>
__device__ __forceinline__ void rewind_dots(const T* x, const T* const (&w)[COLS],
                                            float (&sum)[COLS], const Warp& warp,
                                            const T* norm_w, float normalizer) {
  const int lane = warp.thread_rank();
#pragma unroll
  for (int c = 0; c < COLS; ++c) sum[c] = 0.0f;
#pragma unroll 4
  for (int col = N_PER * lane; col < K; col += 32 * N_PER) {
    auto local_vec = unsafe_load_vector<N_PER>(x + col, 0);
    if constexpr (NORM) {
      auto local_w = unsafe_load_vector<N_PER>(norm_w + col, 0);
#pragma unroll
      for (int j = 0; j < N_PER; ++j) {
        local_vec[j] = local_w[j] * static_cast<T>(static_cast<float>(local_vec[j]) * normalizer);
      }
    }
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      auto local_mat = unsafe_load_vector<N_PER>(w[c] + col, 0);
#pragma unroll
      for (int j = 0; j < N_PER; ++j) {
        sum[c] += static_cast<float>(local_mat[j]) * static_cast<float>(local_vec[j]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    sum[c] = cooperative_groups::reduce(warp, sum[c], cooperative_groups::plus<float>{});
  }
}

// rms_norm_small's normalizer (mlx/backend/cuda/rms_norm.cu) for one row of K elements, in
// one warp: lane l stands for the block's threads l, l + 32, ... (BLOCK of them), each summing
// the squares of its CHUNKS vectors of READS elements (zeros past K, as its bounded loads give)
// in the kernel's order; each group of 32 is reduced as its warp reduces, then the warps' sums
// as the block's second reduction does.
template <typename T, int K, int BLOCK, int CHUNKS, int READS, typename Warp>
__device__ __forceinline__ float rewind_rms_normalizer(const T* x, float eps, const Warp& warp) {
  constexpr int GROUPS = BLOCK / 32;
  const int lane = warp.thread_rank();
  float part[GROUPS];
#pragma unroll
  for (int g = 0; g < GROUPS; ++g) {
    const int index = lane + 32 * g;
    float normalizer = 0;
#pragma unroll
    for (int i = 0; i < CHUNKS; i++) {
      const int offset = BLOCK * i + index;
      AlignedVector<T, READS> xn;
      if constexpr (K == BLOCK * CHUNKS * READS) {
        xn = unsafe_load_vector<READS>(x, offset);
      } else {
#pragma unroll
        for (int j = 0; j < READS; ++j) xn[j] = offset * READS + j < K ? x[offset * READS + j] : T(0);
      }
#pragma unroll
      for (int j = 0; j < READS; ++j) {
        float t = static_cast<float>(xn[j]);
        normalizer += t * t;
      }
    }
    part[g] = cooperative_groups::reduce(warp, normalizer, cooperative_groups::plus<float>{});
  }
  float normalizer = part[0];
  if constexpr (GROUPS > 1) {
    float mine = 0.0f;  // the block reduction's init_value, T{}
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
      if (lane == g) mine = part[g];
    }
    normalizer = cooperative_groups::reduce(warp, mine, cooperative_groups::plus<float>{});
  }
  uint32_t axis_size = K;
  return rsqrt(normalizer / axis_size + eps);
}

// rewind_dots over x normalized first (NORM: norm_w and eps[0], as rms_norm_small) or as it is
template <typename T, int K, int N_PER, int COLS, bool NORM, int NORM_BLOCK, int NORM_CHUNKS,
          int NORM_READS, typename Warp>
__device__ __forceinline__ void rewind_normed_dots(const T* x, const T* const (&w)[COLS],
                                                   float (&sum)[COLS], const Warp& warp,
                                                   const T* norm_w, const float* eps) {
  float normalizer = 0.0f;
  if constexpr (NORM) {
    normalizer = rewind_rms_normalizer<T, K, NORM_BLOCK, NORM_CHUNKS, NORM_READS>(x, eps[0], warp);
  }
  rewind_dots<T, K, N_PER, COLS, NORM>(x, w, sum, warp, norm_w, normalizer);
}

}  // namespace mlx::core::cu
"""

# The q/k/v product and RoPE. Units are pairs (i, i + HALF) of one head's columns, heads in the
# stacked weight's order: HQ query heads, HKV key heads, HKV value heads. rope = [scale,
# log2(base)]; with FREQS, freqs holds the RoPE's frequencies (Llama3RoPE), as MLX's
# rope_single_freqs reads them.
_QKV_ROPE = """
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    constexpr int HALF = HD / 2;
    const int unit = blockIdx.x * WARPS + threadIdx.y;
    if (unit >= (HQ + 2 * HKV) * HALF) return;
    const int head = unit / HALF;
    const int i = unit - head * HALF;
    const size_t first = (size_t)head * HD + i;
    const InT* rows[2] = {w + first * K, w + (first + HALF) * K};
    // RoPE's inputs loaded before the products and used after them: the position is an array
    // of 4 bytes, which MLX keeps in host memory the GPU reads across the bus (and the RoPE
    // constants were too); issued first, that read overlaps the weights'
    const bool rotated = head < HQ + HKV;
    int position = 0;
    float rope_scale = 0.0f, rope_log2_base = 0.0f, freq = 1.0f;
    if (rotated) {
      position = offset[0];
      rope_scale = rope[0];
      rope_log2_base = rope[1];
      if constexpr (FREQS) freq = freqs[i];
    }
    float sum[2];
    rewind_normed_dots<InT, K, N_PER, 2, NORM, NORM_BLOCK, NORM_CHUNKS, NORM_READS>(
        x, rows, sum, warp, norm_w, eps);
    if (warp.thread_rank() != 0) return;
    InT out_1 = static_cast<InT>(sum[0]);
    InT out_2 = static_cast<InT>(sum[1]);
    if (rotated) {
      // rope_single_impl (mlx/backend/cuda/rope.cu), forward, not traditional
      float L = rope_scale * static_cast<float>(position);
      float inv_freq;
      if constexpr (FREQS) {
        inv_freq = 1.0 / freq;
      } else {
        float d = static_cast<float>(i) / static_cast<float>(HALF);
        inv_freq = exp2f(-d * rope_log2_base);
      }
      float theta = L * inv_freq;
      float costheta = cosf(theta);
      float sintheta = sinf(theta);
      float x1 = static_cast<float>(out_1);
      float x2 = static_cast<float>(out_2);
      float rx1 = x1 * costheta - x2 * sintheta;
      float rx2 = x1 * sintheta + x2 * costheta;
      out_1 = static_cast<InT>(rx1);
      out_2 = static_cast<InT>(rx2);
    }
    InT* dst = head < HQ ? q : head < HQ + HKV ? k : v;
    const int h = head < HQ ? head : head < HQ + HKV ? head - HQ : head - HQ - HKV;
    dst[h * HD + i] = out_1;
    dst[h * HD + i + HALF] = out_2;
"""

# A product and the residual add after it: out = res + (x @ w^T), MLX's `Add` on the rounded
# product. COLS adjacent columns a warp.
_PRODUCT_ADD = """
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int unit = blockIdx.x * WARPS + threadIdx.y;
    if (unit >= N / COLS) return;
    const InT* rows[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) rows[c] = w + (size_t)(unit * COLS + c) * K;
    float sum[COLS];
    rewind_dots<InT, K, N_PER, COLS, false>(x, rows, sum, warp, x, 0.0f);
    if (warp.thread_rank() != 0) return;
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int column = unit * COLS + c;
      out[column] = Add{}(res[column], static_cast<InT>(sum[c]));
    }
"""

# The gate/up product and the MLP's gate: out[j] = silu(gate[j]) * up[j], where silu(g) =
# g * sigmoid(g), each step rounded to InT as MLX's fused kernel of mlx-lm's swiglu rounds it.
_GATE_UP = """
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int j = blockIdx.x * WARPS + threadIdx.y;
    if (j >= I) return;
    const InT* rows[2] = {w + (size_t)j * K, w + (size_t)(I + j) * K};
    float sum[2];
    rewind_normed_dots<InT, K, N_PER, 2, NORM, NORM_BLOCK, NORM_CHUNKS, NORM_READS>(
        x, rows, sum, warp, norm_w, eps);
    if (warp.thread_rank() != 0) return;
    const InT gate = static_cast<InT>(sum[0]);
    const InT up = static_cast<InT>(sum[1]);
    const InT sigmoid = Sigmoid{}(gate);
    const InT silu = Multiply{}(gate, sigmoid);
    out[j] = Multiply{}(silu, up);
"""


@functools.lru_cache(maxsize=None)
def _qkv_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="rewind_block_qkv_rope",
        input_names=["x", "w", "offset", "rope", "freqs", "norm_w", "eps"],
        output_names=["q", "k", "v"], source=_QKV_ROPE, header=_HEADER)


@functools.lru_cache(maxsize=None)
def _product_add_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="rewind_block_product_add", input_names=["x", "w", "res"],
        output_names=["out"], source=_PRODUCT_ADD, header=_HEADER)


@functools.lru_cache(maxsize=None)
def _gate_up_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="rewind_block_gate_up", input_names=["x", "w", "norm_w", "eps"],
        output_names=["out"],
        source=_GATE_UP, header=_HEADER)


def available() -> bool:
    return on_cuda()


def wanted() -> bool:
    """REWIND_FUSED_DECODE: auto and on mean on with MLX's CUDA backend (the only one the
    kernels exist for)."""
    return env.fused_decode() != "off" and available()


def _grid(units: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (32 * -(-units // WARPS), WARPS, 1), (32, WARPS, 1)


def _check_product(x: mx.array, weight: mx.array) -> tuple[int, int]:
    """(K, N) of a one-row product x [..., K] @ weight^T; ValueError for what the kernels do
    not take."""
    if weight.ndim != 2 or x.shape[-1] != weight.shape[1] or x.size != weight.shape[1]:
        raise ValueError(f"one row x {x.shape} does not fit weight {weight.shape}")
    if x.dtype != weight.dtype or x.dtype not in (mx.bfloat16, mx.float16):
        raise ValueError(f"bf16 or fp16 x and weight of one dtype, not {x.dtype} / {weight.dtype}")
    return weight.shape[1], weight.shape[0]


def norm_layout(size: int, dtype: Any) -> tuple[int, int, int] | None:
    """(threads, chunks, elements a load) of MLX's rms_norm_small for rows of `size` (its
    dispatch_num_chunks, rms_norm.cu), or None where MLX runs its other norm kernel."""
    reads = 16 // dtype.size
    if size > reads * 128 * 8:
        return None
    vectors = -(-size // reads)
    if size <= reads * 64:
        return 64, 1, reads
    if vectors % 128 == 0 and vectors // 128 <= 8:
        return 128, vectors // 128, reads
    if vectors % 64 == 0 and vectors // 64 <= 8:
        return 64, vectors // 64, reads
    return 128, -(-vectors // 128), reads


Norm = tuple[mx.array, float]  # an RMSNorm's weight [K] and eps


def _norm_inputs(x: mx.array, k: int, norm: Norm | None
                 ) -> tuple[list[mx.array], list[tuple[str, Any]]]:
    """The kernels' norm_w and eps inputs and NORM template arguments for `norm` (None: the
    caller's x is already normalized)."""
    if norm is None:
        return [_dummy(x.dtype), _dummy(mx.float32)], [
            ("NORM", False), ("NORM_BLOCK", 32), ("NORM_CHUNKS", 1), ("NORM_READS", 1)]
    weight, eps = norm
    layout = norm_layout(k, x.dtype)
    if weight.shape != (k,) or weight.dtype != x.dtype or layout is None:
        raise ValueError(f"norm weight {weight.shape} {weight.dtype} for rows of {k} {x.dtype}")
    block, chunks, reads = layout
    return [weight, constant_floats(eps)], [
        ("NORM", True), ("NORM_BLOCK", block), ("NORM_CHUNKS", chunks), ("NORM_READS", reads)]


def qkv_rope(x: mx.array, weight: mx.array, offset: mx.array, heads: tuple[int, int, int],
             rope_scale: float, rope_base: float | None, freqs: mx.array | None,
             norm: Norm | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """One row's x @ weight^T for the stacked q/k/v weight [(HQ + 2 HKV) * HD, K], with RoPE
    at position `offset` (int32, its first element) on the query and key heads: (q [1, HQ, 1,
    HD], k and v [1, HKV, 1, HD]). `heads` = (HQ, HKV, HD); RoPE from `rope_base` (nn.RoPE) or
    from `freqs` (HD / 2 frequencies, Llama3RoPE), each with `rope_scale` on the position. With
    `norm`, x is first normalized as mx.fast.rms_norm(x, *norm) would."""
    k, n = _check_product(x, weight)
    query_heads, kv_heads, head_dim = heads
    if head_dim % 2 or n != (query_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"weight {weight.shape} is not q/k/v of {heads} heads")
    if offset.ndim != 1 or offset.size < 1 or offset.dtype != mx.int32:
        raise ValueError(f"offset: int32 [n >= 1] whose first element is the position, got "
                         f"{offset.shape} {offset.dtype}")
    if (freqs is None) == (rope_base is None):
        raise ValueError("RoPE from a base or from frequencies, one of them")
    if freqs is not None and freqs.shape != (head_dim // 2,):
        raise ValueError(f"{head_dim // 2} RoPE frequencies, got {freqs.shape}")
    norm_inputs, norm_template = _norm_inputs(x, k, norm)
    grid, threads = _grid((query_heads + 2 * kv_heads) * head_dim // 2)
    # MLX passes std::log2 of its float base: the float nearest log2(base)
    rope = constant_floats(rope_scale, math.log2(rope_base) if rope_base is not None else 0.0)
    return tuple(_qkv_kernel()(
        inputs=[x, weight, offset, rope,
                freqs.astype(mx.float32) if freqs is not None else _dummy(mx.float32),
                *norm_inputs],
        template=[("InT", x.dtype), ("K", k), ("N_PER", cuda_rows.elements_per_lane(k)),
                  ("HQ", query_heads), ("HKV", kv_heads), ("HD", head_dim),
                  ("WARPS", WARPS), ("FREQS", freqs is not None), *norm_template],
        grid=grid, threadgroup=threads,
        output_shapes=[(1, query_heads, 1, head_dim), (1, kv_heads, 1, head_dim),
                       (1, kv_heads, 1, head_dim)],
        output_dtypes=[x.dtype] * 3))


@functools.lru_cache(maxsize=None)
def _dummy(dtype: Any) -> mx.array:
    """An input a kernel variant does not read."""
    return mx.zeros((1,), dtype)


def product_add(x: mx.array, weight: mx.array, residual: mx.array) -> mx.array:
    """residual + x @ weight^T for one row: [1, 1, N], residual [..., N] of one row."""
    k, n = _check_product(x, weight)
    if residual.size != n or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.shape} {residual.dtype} for {n} outputs")
    cols = 2 if n % 2 == 0 else 1
    grid, threads = _grid(n // cols)
    return _product_add_kernel()(
        inputs=[x, weight, residual],
        template=[("InT", x.dtype), ("K", k), ("N_PER", cuda_rows.elements_per_lane(k)),
                  ("N", n), ("COLS", cols), ("WARPS", WARPS)],
        grid=grid, threadgroup=threads, output_shapes=[(1, 1, n)],
        output_dtypes=[x.dtype])[0]


def gate_up(x: mx.array, weight: mx.array, norm: Norm | None = None) -> mx.array:
    """silu(gate) * up for one row, gate and up the halves of x @ weight^T (the stacked
    [2 I, K] weight): [1, 1, I]. With `norm`, x is first normalized (see qkv_rope)."""
    k, n = _check_product(x, weight)
    if n % 2:
        raise ValueError(f"weight {weight.shape}: gate and up rows stacked, an even count")
    norm_inputs, norm_template = _norm_inputs(x, k, norm)
    grid, threads = _grid(n // 2)
    return _gate_up_kernel()(
        inputs=[x, weight, *norm_inputs],
        template=[("InT", x.dtype), ("K", k), ("N_PER", cuda_rows.elements_per_lane(k)),
                  ("I", n // 2), ("WARPS", WARPS), *norm_template],
        grid=grid, threadgroup=threads, output_shapes=[(1, 1, n // 2)],
        output_dtypes=[x.dtype])[0]


# ---- which blocks take it ----------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    """A Llama attention's heads and RoPE, where its q/k/v product and RoPE are fused."""

    query_heads: int
    kv_heads: int
    head_dim: int
    rope_scale: float
    rope_base: float | None  # nn.RoPE's base, or None where the RoPE has frequencies


@dataclass(frozen=True)
class BlockShape:
    """What a block's fused call needs beside its weights (read from the modules at each call):
    the MLP half always; the attention half where `attention` is set (else mlx-lm's attention
    module runs it)."""

    dtype: Any  # the weights'
    norms: bool  # whether the products can compute the norms before them (norm_layout)
    attention: AttentionShape | None


def _plain_linear(module: Any, dtype: Any = None) -> bool:
    """A bias-free bf16/fp16 Linear (cuda_rows' kind), of `dtype` where given."""
    return cuda_rows.takes_linear(module) and (dtype is None or module.weight.dtype == dtype)


def _fused_weight(module: Any, names: tuple[str, ...], dtype: Any) -> mx.array | None:
    """The stacked weight of `names` where they run as one product: rewind.models.
    fused_projections puts a part holding the shared product (`_shared`, whose `layer` is the
    fused layer) where each was, and the fused layer under the names joined by "_" (read by
    attribute: that package sits above this one)."""
    parts = [module.get(name) if isinstance(module, dict) else None for name in names]
    shared = {id(getattr(part, "_shared", None)) for part in parts}
    layer = module.get("_".join(names)) if isinstance(module, dict) else None
    if (len(shared) != 1 or getattr(parts[0], "_shared", None) is None or layer is None
            or getattr(parts[0]._shared, "layer", None) is not layer
            or not _plain_linear(layer, dtype)):
        return None
    return layer.weight


def _rope_of(attention: Any, head_dim: int) -> tuple[float, float | None] | None:
    """(scale, base) for nn.RoPE, (1.0, None) for Llama3RoPE (its frequencies), over the whole
    head and not traditional; None for another RoPE."""
    rope = attention.rope
    if getattr(rope, "dims", None) != head_dim or getattr(rope, "traditional", True):
        return None
    if type(rope) is nn.RoPE:
        return float(rope.scale), float(rope.base)
    from mlx_lm.models.rope_utils import Llama3RoPE

    if type(rope) is Llama3RoPE and getattr(rope, "_freqs", None) is not None \
            and rope._freqs.shape == (head_dim // 2,):
        return 1.0, None
    return None


def _families() -> tuple[set[type], set[type]]:
    """mlx-lm's block classes whose call is `r = attention(input_layernorm(x), mask, cache);
    h = x + r; out = h + mlp(post_attention_layernorm(h))`, and its MLP classes whose call is
    `down_proj(swiglu(gate_proj(x), up_proj(x)))` (read in mlx-lm 0.32's sources)."""
    from mlx_lm.models import llama, qwen2, qwen3, qwen3_5, qwen3_next

    return ({llama.TransformerBlock, qwen2.TransformerBlock, qwen3.TransformerBlock,
             qwen3_5.DecoderLayer},
            {llama.MLP, qwen2.MLP, qwen3.MLP, qwen3_next.Qwen3NextMLP})


def _attention_module(block: Any) -> Any:
    """The module a block's call attends with (Qwen 3.5's layers: linear or full attention)."""
    return block.linear_attn if getattr(block, "is_linear", False) else block.self_attn


def _attention_shape(block: Any, hidden: int, dtype: Any) -> AttentionShape | None:
    """A Llama block's attention where its q/k/v product and RoPE can be fused."""
    from mlx_lm.models import llama

    from rewind.kernels.rebind import computes_as

    if computes_as(type(block)) is not llama.TransformerBlock:
        return None
    attention = block.self_attn
    o_proj = attention.o_proj
    qkv = _fused_weight(attention, ("q_proj", "k_proj", "v_proj"), dtype)
    if qkv is None or not _plain_linear(o_proj, dtype):
        return None
    heads, kv_heads, head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    if (head_dim % 2 or qkv.shape != ((heads + 2 * kv_heads) * head_dim, hidden)
            or o_proj.weight.shape != (hidden, heads * head_dim)):
        return None
    rope = _rope_of(attention, head_dim)
    if rope is None:
        return None
    return AttentionShape(heads, kv_heads, head_dim, rope[0], rope[1])


def block_shape(block: Any) -> BlockShape | None:
    """The block's shape where its decode call can be fused (see the module docstring)."""
    from rewind.kernels.rebind import computes_as

    blocks, mlps = _families()
    if computes_as(type(block)) not in blocks or getattr(block, "use_sliding", False):
        return None
    mlp = block.get("mlp") if isinstance(block, dict) else None
    if mlp is None or computes_as(type(mlp)) not in mlps:
        return None
    norms = (block.input_layernorm, block.post_attention_layernorm)
    down = mlp.down_proj
    if not all(type(norm) is nn.RMSNorm for norm in norms) or not _plain_linear(down):
        return None
    dtype = down.weight.dtype
    gu = _fused_weight(mlp, ("gate_proj", "up_proj"), dtype)
    hidden = down.weight.shape[0]
    if gu is None or gu.shape != (2 * down.weight.shape[1], hidden):
        return None
    fusable = all(norm.weight.shape == (hidden,) and norm.weight.dtype == dtype for norm in norms)
    return BlockShape(dtype, fusable and norm_layout(hidden, dtype) is not None,
                      _attention_shape(block, hidden, dtype))


def _attention_function(attention: Any) -> Any:
    """What the attention module's own call would score with: Rewind's routed kernel
    (rewind.kernels.rebind) or mlx-lm's function."""
    from mlx_lm.models import base

    from rewind.kernels.rebind import routes

    return routes(attention).get("scaled_dot_product_attention",
                                 base.scaled_dot_product_attention)


def fused_call(block: Any, shape: BlockShape, x: mx.array, mask: Any, cache: Any) -> mx.array:
    """The block's call for one row and one token, in the fused kernels (module docstring)."""
    mlp = block.mlp
    before, after = block.input_layernorm, block.post_attention_layernorm
    fuse_norms = FUSE_NORMS and shape.norms
    if shape.attention is None:
        h = x + _attention_module(block)(before(x), mask, cache)
    else:
        h = _fused_attention(block, shape.attention, x, mask, cache,
                             (before.weight, before.eps) if fuse_norms else None)
    gated = gate_up(h if fuse_norms else after(h), mlp.gate_proj_up_proj.weight,
                    (after.weight, after.eps) if fuse_norms else None)
    return product_add(gated, mlp.down_proj.weight, h)


def _fused_attention(block: Any, shape: AttentionShape, x: mx.array, mask: Any, cache: Any,
                     norm: Norm | None) -> mx.array:
    """x + attention(input_layernorm(x)) for a Llama block, the products fused."""
    attention = block.self_attn
    offset = cache.offset
    if isinstance(offset, int):
        offset = mx.array([offset], mx.int32)
    else:  # a compiled step's view: [1] int32 already
        if offset.shape != (1,):
            offset = offset.reshape(1)
        if offset.dtype != mx.int32:
            offset = offset.astype(mx.int32)
    freqs = attention.rope._freqs if shape.rope_base is None else None
    queries, keys, values = qkv_rope(
        x if norm is not None else block.input_layernorm(x),
        attention.q_proj_k_proj_v_proj.weight, offset,
        (shape.query_heads, shape.kv_heads, shape.head_dim), shape.rope_scale, shape.rope_base,
        freqs, norm)
    keys, values = cache.update_and_fetch(keys, values)
    scores = _attention_function(attention)(queries, keys, values, cache=cache,
                                            scale=attention.scale, mask=mask)
    # [1, HQ, 1, HD] -> [1, 1, HQ * HD]: for one row and token the transpose mlx-lm makes first
    # moves nothing
    return product_add(scores.reshape(1, 1, -1), attention.o_proj.weight, x)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    """A subclass of the block's class whose call takes the fused kernels where it can."""
    if cls not in _FUSED_CLASSES:
        from rewind.kernels.rebind import computes_as, register_stand_in

        def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            shape = self.__dict__.get("_rewind_block_shape")
            if (shape is not None and cache is not None and x.ndim == 3
                    and x.shape[0] == 1 and x.shape[1] == 1 and x.dtype == shape.dtype
                    and not cuda_rows.rows_alone_on() and wanted()):
                return fused_call(self, shape, x, mask, cache)
            return super(fused, self).__call__(x, mask, cache)

        fused = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": __name__})
        register_stand_in(fused, computes_as(cls))  # the same bits
        _FUSED_CLASSES[cls] = fused
    return _FUSED_CLASSES[cls]


def _same_as_plain(block: Any, shape: BlockShape) -> str | None:
    """None where the block's fused call gives its plain call's bits (random activations, at
    three positions); else what differed. With a fused attention, the whole block's output
    and the cache's new key and value over a cache of those many keys; otherwise the MLP half,
    the part fused (the attention half is mlx-lm's own call either way)."""
    from mlx_lm.models.cache import KVCache

    hidden = block.mlp.down_proj.weight.shape[0]
    for position in (300, 301, 4097):
        x = (mx.random.normal((1, 1, hidden), key=mx.random.key(position)) * 4).astype(
            shape.dtype)
        if shape.attention is None:
            plain = x + block.mlp(block.post_attention_layernorm(x))
            fused = product_add(gate_up(x if FUSE_NORMS and shape.norms
                                        else block.post_attention_layernorm(x),
                                        block.mlp.gate_proj_up_proj.weight,
                                        (block.post_attention_layernorm.weight,
                                         block.post_attention_layernorm.eps)
                                        if FUSE_NORMS and shape.norms else None),
                                block.mlp.down_proj.weight, x)
            compared = [("the MLP half", plain, fused)]
        else:
            heads = shape.attention
            caches = []
            for _ in range(2):
                cache = KVCache()
                prefix = (1, heads.kv_heads, position, heads.head_dim)
                cache.update_and_fetch(
                    mx.random.normal(prefix, key=mx.random.key(1)).astype(shape.dtype),
                    mx.random.normal(prefix, key=mx.random.key(2)).astype(shape.dtype))
                caches.append(cache)
            plain = block(x, None, caches[0])
            fused = fused_call(block, shape, x, None, caches[1])
            compared = [("output", plain, fused),
                        ("keys", caches[0].keys[..., position, :],
                         caches[1].keys[..., position, :]),
                        ("values", caches[0].values[..., position, :],
                         caches[1].values[..., position, :])]
        for what, a, b in compared:
            if not mx.array_equal(a, b).item():
                diff = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
                return f"{what} at position {position} (largest difference {diff:.3g})"
    return None


def _kind(block: Any, shape: BlockShape) -> tuple[Any, ...]:
    """Blocks that compute alike: one check stands for all of them."""
    return (type(block), getattr(block, "is_linear", False), shape)


def use_in_model(model: Any) -> int:
    """Give every block of `model` that can take the fused call the class that takes it, once
    the first block of its kind gave its plain call's bits on this device; returns how many
    blocks. Nothing changes off CUDA, with REWIND_FUSED_DECODE=off, or for a kind whose check
    fails (logged)."""
    if not wanted():
        return 0
    blocks = [(module, shape) for _, module in model.named_modules()
              if (shape := block_shape(module)) is not None
              and (shape.attention is not None or FUSE_MLP_HALVES)]
    verdicts: dict[tuple[Any, ...], str | None] = {}
    switched = 0
    for block, shape in blocks:
        kind = _kind(block, shape)
        if kind not in verdicts:
            try:
                verdicts[kind] = _same_as_plain(block, shape)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build: mlx-lm's
                verdicts[kind] = f"{type(exc).__name__}: {exc}"
            if verdicts[kind] is not None:
                log.warning("rewind.kernels.cuda_block: the fused decode block differs from "
                            "mlx-lm's %s (%s); those blocks keep mlx-lm's call",
                            type(block).__name__, verdicts[kind])
        if verdicts[kind] is None:
            block.__class__ = _fused_class(type(block))
            block.__dict__["_rewind_block_shape"] = shape
            switched += 1
    return switched


def fused_in(model: Any) -> int:
    """How many of `model`'s blocks take the fused call."""
    return sum(1 for _, module in model.named_modules()
               if "_rewind_block_shape" in getattr(module, "__dict__", {}))
