"""Decode-sized matrix products on CUDA: x [P, K] @ W^T for a few rows P, with the RMS norm
before them and the gated MLP's activation after them folded in (mx.fast.cuda_kernel).

Why: on a GPU a small model's decode step is bound by the host, and MLX's host cost is paid per
kernel (each one a node MLX adds to a CUDA graph, updates and launches every step: ~8.6 us of
CUDA calls a kernel at 32 rows of Llama-3.2-1B on an H100, decode-profile-compiled-h100-9b8225f).
A Llama layer's decode step is ~15 kernels, of which two RMS norms and the MLP's
`silu(gate) * up` exist only to feed or follow a product. And MLX's one-row product
(`gemv_single`) reads the weights at about half the card's bandwidth, while from 2 rows up each
product is a cuBLAS call that MLX captures as a child graph (more host work than a kernel node).

This kernel is one warp per output column (two for the gated MLP: the gate's and the up's), 16-
byte loads of W, UNROLL of them in flight per lane before they are used, each row of x read
through the cache. Each row of x is summed alone, in one fixed order: a lane's slices of K in
increasing order, one fused multiply-add per element into one float, then the warp's 32 lane
sums in a butterfly of shuffles. So a row's result does not depend on how many rows the call
has, which rows are its neighbours or how the rows are grouped: a drafted row's check (several
positions of one row) computes each position as a one-token step does.

Folded in:
- `norm` (an RMS norm's weight g and eps, as mx.fast.rms_norm): the product of
  `rms_norm(x) = x * rsqrt(mean(x^2) + eps) * g`. The sum of squares is taken in the same pass
  over x; the norm's output is never formed, so it is not rounded to x's dtype first (the
  product differs from the unfused pair by that rounding).
- `gated` (W the gate's and the up's weights stacked, [2I, K], as rewind.models
  .fused_projections stacks them): `silu(gate) * up` [P, I], each rounded to x's dtype first as
  the separate products would be.

What it takes: bf16 or fp16 x and W of one dtype, K a multiple of 8 (16-byte rows), up to
MAX_ROWS rows. Rows beyond GROUP_ROWS read W again (once per group of 8).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

GROUP_ROWS = 8  # rows summed in one pass over W: a float sum per row and output column a lane
MAX_ROWS = 64
WARPS = 4  # warps a block, one output column (pair) each
UNROLL = 4  # 16-byte loads of each W row in flight per lane
VEC_BYTES = 16

_SOURCE = """
    constexpr int VEC = 16 / sizeof(InT);
    constexpr int C = GATED ? 2 : 1;  // W rows a warp reads: the column, or gate and up
    constexpr int STEP = 32 * VEC;  // elements of K a warp covers per load
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int rows = shape[0];
    const int n = shape[1];
    const int k = shape[2];
    const int units = GATED ? n / 2 : n;
    const int unit = blockIdx.x * WARPS + warp;
    if (unit >= units) return;
    const int first = blockIdx.y * ROWS;
    const int here = min(ROWS, rows - first);
    const InT* wr[C];
#pragma unroll
    for (int c = 0; c < C; ++c) wr[c] = w + (size_t)(unit + c * units) * k;
    const InT* xr = x + (size_t)first * k;
    // 16-byte loads where every row start allows them; the other copy of the loop sums in the
    // same order, one element at a time
    const bool wide = ((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(x)
                        | (NORM ? reinterpret_cast<size_t>(g) : 0)) % 16 == 0) && k % VEC == 0;
    float acc[C][ROWS];
    float sq[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      sq[r] = 0.0f;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[c][r] = 0.0f;
    }
    for (int base = lane * VEC; base < k; base += STEP * UNROLL) {
      InT wv[UNROLL][C][VEC];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int at = base + u * STEP;
        if (at < k) {
#pragma unroll
          for (int c = 0; c < C; ++c) {
            if (wide) {
              *reinterpret_cast<uint4*>(wv[u][c]) = *reinterpret_cast<const uint4*>(wr[c] + at);
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) wv[u][c][e] = at + e < k ? wr[c][at + e] : InT(0.0f);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int at = base + u * STEP;
        if (at >= k) break;
        float gf[VEC];
        if (NORM) {
          InT gv[VEC];
          if (wide) {
            *reinterpret_cast<uint4*>(gv) = *reinterpret_cast<const uint4*>(g + at);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) gv[e] = at + e < k ? g[at + e] : InT(0.0f);
          }
#pragma unroll
          for (int e = 0; e < VEC; ++e) gf[e] = static_cast<float>(gv[e]);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (r < here) {
            InT xv[VEC];
            if (wide) {
              *reinterpret_cast<uint4*>(xv) =
                  *reinterpret_cast<const uint4*>(xr + (size_t)r * k + at);
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e)
                xv[e] = at + e < k ? xr[(size_t)r * k + at + e] : InT(0.0f);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              float xf = static_cast<float>(xv[e]);
              if (NORM) {
                sq[r] = fmaf(xf, xf, sq[r]);
                xf = xf * gf[e];
              }
#pragma unroll
              for (int c = 0; c < C; ++c)
                acc[c][r] = fmaf(static_cast<float>(wv[u][c][e]), xf, acc[c][r]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (r < here) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
          for (int c = 0; c < C; ++c) acc[c][r] += __shfl_xor_sync(0xffffffff, acc[c][r], offset);
          if (NORM) sq[r] += __shfl_xor_sync(0xffffffff, sq[r], offset);
        }
        if (lane == 0) {
          float scale = 1.0f;
          if (NORM) scale = rsqrtf(sq[r] / static_cast<float>(k) + eps[0]);
          const size_t row = (size_t)(first + r);
          if (GATED) {
            const float gate = static_cast<float>(static_cast<InT>(acc[0][r] * scale));
            const float up = static_cast<float>(static_cast<InT>(acc[1][r] * scale));
            const float act = static_cast<float>(static_cast<InT>(gate / (1.0f + expf(-gate))));
            out[row * units + unit] = static_cast<InT>(act * up);
          } else {
            out[row * units + unit] = static_cast<InT>(acc[0][r] * scale);
          }
        }
      }
    }
"""


def available() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    # g and eps are read only where NORM: without a norm they are W and a zero (the source
    # names every input whatever the template)
    return mx.fast.cuda_kernel(name="rewind_decode_gemv",
                               input_names=["x", "w", "shape", "g", "eps"],
                               output_names=["out"], source=_SOURCE)


def takes(x: mx.array, weight: mx.array, rows: int | None = None) -> bool:
    """Whether `linear` takes this call (else it raises): see the module docstring."""
    if rows is None:
        rows = x.size // x.shape[-1] if x.ndim else 0
    return (weight.ndim == 2 and x.ndim >= 1 and x.shape[-1] == weight.shape[1]
            and x.dtype == weight.dtype and x.dtype in (mx.bfloat16, mx.float16)
            and 1 <= rows <= MAX_ROWS and weight.shape[1] % 8 == 0)


def linear(x: mx.array, weight: mx.array, *, norm: tuple[mx.array, float] | None = None,
           gated: bool = False) -> mx.array:
    """x [..., K] @ weight^T for weight [N, K] -> [..., N]; with `norm` (weight, eps) of x
    RMS-normed first; with `gated` silu(first half) * second half -> [..., N / 2]. Raises
    ValueError for what the kernel does not take (`takes`)."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if not takes(x, weight, rows):
        raise ValueError(f"rows of {x.shape} {x.dtype} against weight {weight.shape} "
                         f"{weight.dtype}: bf16/fp16 of one dtype, K a multiple of 8, "
                         f"1 to {MAX_ROWS} rows")
    n, k = weight.shape
    if gated and n % 2:
        raise ValueError(f"a gated product needs an even number of outputs, not {n}")
    units = n // 2 if gated else n
    group = min(GROUP_ROWS, 1 << (rows - 1).bit_length())
    scale, eps = weight, 0.0
    if norm is not None:
        scale, eps = norm
        if scale.shape != (k,) or scale.dtype != x.dtype:
            raise ValueError(f"a norm weight of shape ({k},) and dtype {x.dtype}, "
                             f"not {scale.shape} {scale.dtype}")
    inputs = [x.reshape(rows, k), weight, mx.array([rows, n, k], mx.int32), scale,
              mx.array([eps], mx.float32)]
    out = _kernel()(
        inputs=inputs,
        template=[("InT", x.dtype), ("ROWS", group), ("GATED", int(gated)),
                  ("NORM", int(norm is not None)), ("WARPS", WARPS), ("UNROLL", UNROLL)],
        grid=(32 * WARPS * -(-units // WARPS), -(-rows // group), 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, units)], output_dtypes=[x.dtype])[0]
    return out.reshape(*x.shape[:-1], units)
