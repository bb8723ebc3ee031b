"""The gated delta rule's recurrence as a CUDA kernel (mx.fast.cuda_kernel): mlx-lm's Metal
kernel for it, ported. Without it, MLX's CUDA backend runs mlx-lm's `gated_delta_ops`, a Python
loop of per-token graphs: a random Qwen 3.5-like 2B model prefilled at 470 tokens/s on an H200
(../shared/GPU.md), where its other layers run at tens of thousands.

One warp per (batch row, value head, value row): each lane holds Dk / 32 elements of that state
row in registers for the whole chunk, and the two dot products of a step are warp sums. A
padding step (mask false) leaves the state alone and writes 0, as mlx-lm's Metal kernel does.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from rewind.kernels.cuda_device import on_cuda

_SOURCE = """
    const int lane = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    if (dv_idx >= Dv) return;  // a whole warp: the shuffles below see all 32 lanes
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    const int T = steps[0];
    constexpr int n_per_t = Dk / 32;

    const InT* q_ = q + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk;
    const InT* k_ = k + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk;
    const InT* v_ = v + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    InT* y_ = y + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    const float* g_ = g + (size_t)b_idx * T * Hv * G_STRIDE + hv_idx * G_STRIDE;
    const float* beta_ = beta + (size_t)b_idx * T * Hv + hv_idx;
    const float* i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk;
    float* o_state = state_out + ((size_t)n * Dv + dv_idx) * Dk;

    float state[n_per_t];
    for (int i = 0; i < n_per_t; ++i) state[i] = i_state[n_per_t * lane + i];

    for (int t = 0; t < T; ++t) {
      if (KEEP) {
        float kv_mem = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          const int s_idx = n_per_t * lane + i;
          state[i] = state[i] * G_AT(s_idx);
          kv_mem += state[i] * static_cast<float>(k_[s_idx]);
        }
        for (int offset = 16; offset > 0; offset /= 2)
          kv_mem += __shfl_xor_sync(0xffffffff, kv_mem, offset);
        const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * beta_[0];
        float out = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {
          const int s_idx = n_per_t * lane + i;
          state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
          out += state[i] * static_cast<float>(q_[s_idx]);
        }
        for (int offset = 16; offset > 0; offset /= 2)
          out += __shfl_xor_sync(0xffffffff, out, offset);
        if (lane == 0) y_[dv_idx] = static_cast<InT>(out);
      } else if (lane == 0) {
        y_[dv_idx] = static_cast<InT>(0.0f);
      }
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      g_ += Hv * G_STRIDE;
      beta_ += Hv;
    }
    for (int i = 0; i < n_per_t; ++i) o_state[n_per_t * lane + i] = state[i];
"""

ROWS_PER_BLOCK = 4  # warps per thread block (value rows of one head)


@functools.lru_cache(maxsize=None)
def _kernel(per_key_gate: bool, masked: bool) -> Any:
    source = (_SOURCE
              .replace("G_STRIDE", "Dk" if per_key_gate else "1")
              .replace("G_AT(s_idx)", "g_[s_idx]" if per_key_gate else "g_[0]")
              .replace("KEEP", "mask[b_idx * T + t]" if masked else "true"))
    inputs = ["q", "k", "v", "g", "beta", "state_in", "steps"] + (["mask"] if masked else [])
    return mx.fast.cuda_kernel(
        name=f"rewind_gated_delta{'_vec' if per_key_gate else ''}{'_mask' if masked else ''}",
        input_names=inputs, output_names=["y", "state_out"], source=source)


def available() -> bool:
    return on_cuda()


def supported(q: mx.array) -> bool:
    return q.shape[-1] % 32 == 0


def recurrence(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
               state: mx.array, mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """mlx_lm.models.gated_delta.gated_delta_ops in the kernel (shapes as there; Dk a multiple
    of 32). Returns (y [B, T, Hv, Dv] in q's dtype, state float32)."""
    batch, steps, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[-2:]
    if g.ndim not in (3, 4):
        raise ValueError(f"unsupported gating shape {g.shape}")
    inputs = [q, k.astype(q.dtype), v.astype(q.dtype), g.astype(mx.float32),
              beta.astype(mx.float32), state.astype(mx.float32), mx.array([steps], mx.int32)]
    if mask is not None:
        inputs.append(mx.broadcast_to(mask, (batch, steps)).astype(mx.bool_))
    return tuple(_kernel(g.ndim == 4, mask is not None)(
        inputs=inputs,
        template=[("InT", q.dtype), ("Dk", key_dim), ("Dv", value_dim), ("Hk", key_heads),
                  ("Hv", value_heads)],
        grid=(32, value_dim, batch * value_heads),
        threadgroup=(32, ROWS_PER_BLOCK, 1),
        output_shapes=[(batch, steps, value_heads, value_dim), state.shape],
        output_dtypes=[q.dtype, mx.float32]))
