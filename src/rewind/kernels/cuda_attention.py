"""Decode attention for a batch of rows of mixed lengths on CUDA (mx.fast.cuda_kernel).

A decode step's rows sit left-padded in one KV buffer (mlx-lm's BatchKVCache): row b's keys are
slots [left_padding[b], T). MLX's fused attention takes no per-row lengths, so such a batch
passes a boolean mask, and MLX's CUDA backend then runs its unfused path: the scores as a
batched matrix-vector product, a softmax, a second product (`gemv_batched` was 4.26 ms of a
32-stream step's 7.5 ms of GPU time on an H100, Llama-3.2-1B shape; one layer's masked
attention at 32 rows of 1,152 keys 0.61 ms against 0.32 ms unmasked, both measured there).

This kernel reads each row's keys from its first real slot, so padding costs nothing. One
thread block per (row, key-value head) and span of keys counted from the row's first key (one
block per row and head when every row fits one span; else a second kernel joins the spans'
partial sums in order, so that a few rows still fill the GPU), WARPS warps. A row's keys are
cut into at most MAX_SPANS spans of at least KEYS_PER_SPAN keys, a size taken from that row's
own key count. A key is shared by D / VEC lanes, each loading VEC elements of it (16 bytes of bf16 where it can),
so a warp takes 32 / (D / VEC) keys at once: warp w takes the span's keys from w times that, a
warp's stride further each time, and loads its next keys before it uses these. Each key and
value is read once for all the query heads of its group (four for Llama-3.2-1B: the kernel per
query head read them four times, 2.1 ms of a 32-stream step's 3.76 ms of GPU time on an H100).
A warp keeps one running maximum per query head for its keys at once (one rescale a step, not
one a key), its key slots' sums join at the end, and the warps' partial sums are combined in a
fixed order. A row's result therefore does not depend on its padding or on the other rows of
the batch (D a multiple of 32, up to 256).

What it takes: one query token per row ([B, Hq, 1, D]), keys and values in one contiguous
[B, Hkv, capacity, D] buffer each of the queries' dtype, Hq a multiple of Hkv, no sinks, no
sliding window. A row with no key gets zeros. Anything else goes to MLX (`_attention` below
decides). The spans' partial sums are scratch of B x Hq x spans x (D + 2) floats a layer, at
most MAX_SPANS spans (64 rows of 32 heads of 128: 34 MB for a moment).
`REWIND_CUDA_ATTENTION=off` keeps MLX's masked attention for every step (read at each call).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from rewind import env
from rewind.kernels import cuda_rows, prompt_shapes
from rewind.kernels.cuda_device import constant_floats, on_cuda

WARPS = 8  # warps per block: keys of a span split 8 ways
# Keys per block, at least. A row's spans are sized from its own key count (at most MAX_SPANS
# of them, each at least this), never from the batch: how a row's keys are split depends on
# that row alone (the split-size rule of batch-invariant decoding). Until 2026-12-07 the span
# was this fixed count, so a lone row of 1,100 keys ran in two blocks a key-value head: 16
# blocks on a 132-SM H100, 52 us a layer, 0.89 ms of a one-stream Llama-3.2-1B step's 2.2 ms of
# GPU time (decode-profile-h100-159a5d2, the compiled step, which always takes this kernel).
# The fixed 1,024 had been chosen on batches (f1d3081 and 33dadea, H100, sdpa_mask_cost.py:
# 32 rows of 4,096 keys 0.176-0.184 ms, spans of 256 0.193, one block 0.188). At least 128 keys
# in at most 16 spans, GPU time a call through CUPTI at Llama-3.2-1B's heads (e433505): one row
# of 1,100 keys 0.077 ms against 0.102 for the fixed 1,024 and 0.147 in one block a head; the
# batched cases within each other's noise there (sdpa-mask-cost-gpu-times-h100-e433505.json).
# With rounds of key sets (UNROLL), 8 warps take 128 of Llama's 64-wide keys a round, so a span
# of 128 left each warp one round and nothing to load ahead: at least 256 keys a span measured
# faster in the same process (attention_chain.py, CUPTI GPU time a layer's call, H100,
# 2026-12-07): one row of 1,100 keys 0.021 ms against 0.042-0.048, 8 rows of 1,152 0.039 against
# 0.059-0.069, 32 rows 0.064 against 0.086-0.088; 4,096 and 32,768 keys the same.
KEYS_PER_SPAN = 256
# Spans a row's keys are cut into, at most (the grid's spans: the combine reads them all).
MAX_SPANS = 16
# Elements of a key each lane loads (None: _elements_per_lane's rule). D / this many lanes
# share a key, so a warp takes 32 / (D / this) keys at once: 8 elements of Llama-3.2-1B's
# 64-wide heads are one 16-byte load a lane and four keys a warp. The first kernel's lane held
# D / 32 elements of one key a warp (4 bytes a lane here) and reached ~27% of the HBM bandwidth
# at 32 rows of 4,096 keys on an H100 (benchmarks/probes/sdpa_mask_cost.py times the choices).
ELEMENTS_PER_LANE: int | None = None
# Sets of a warp's keys one round takes (None: _unroll's rule): every score of a round is
# reduced before any is used, so more sets overlap more shuffle chains and rescale less often,
# for registers (each set holds a key and a value a lane, twice over for the next round's loads).
UNROLL: int | None = None
# Floats a lane may hold in queries, outputs, scores and keys in flight before a round takes
# fewer sets (ptxas: ~230 registers for Qwen 3.5's 256-wide heads at one set, no spills).
_ROUND_FLOATS = 128
# Query tokens a row may bring (a drafted row's check: its input and up to 16 drafts), each a
# query row of the grid.
MAX_POSITIONS = 64
_SHARED_BYTES = 48 * 1024  # static shared memory a block may take without opting in
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's y (spans) and z (positions) sizes

# Loads a lane's VEC elements as floats: 16-byte loads where the element type allows and the
# buffers are aligned (WIDE, decided once per block: two copies of the loop, not a predicate on
# every load), one element at a time elsewhere; nothing (zeros) for a slot past the span.
# Scores are kept in base 2 (the queries carry log2(e)), so each exponential is one ex2.approx:
# the accurate expf took nine instructions, and the loop was bound by instruction issue (354 a
# step of four keys on sm_90 before this, from nvdisasm).
_HEADER = """
template <bool B>
struct rewind_flag {
  static constexpr bool value = B;
};

template <typename T, int N, bool WIDE>
__device__ __forceinline__ void rewind_load_row(const T* src, float* dst, bool in_span) {
  if (!in_span) {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = 0.0f;
    return;
  }
  constexpr int BYTES = N * (int)sizeof(T);
  if constexpr (WIDE && BYTES % 16 == 0) {
    uint4 words[BYTES / 16];
#pragma unroll
    for (int j = 0; j < BYTES / 16; ++j) words[j] = reinterpret_cast<const uint4*>(src)[j];
    const T* elements = reinterpret_cast<const T*>(words);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = static_cast<float>(elements[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// 2^x; exactly 1 where a caller needs it is left to the caller (x == 0)
__device__ __forceinline__ float rewind_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""

# The block's work, shared by the kernel that writes a row's result (SPLIT 0) and the one that
# writes one span of CHUNK keys' partial sums (SPLIT 1) for _COMBINE_SOURCE to join.
_BODY = """
    constexpr int TPK = D / VEC;  // lanes that share a key
    constexpr int KPW = 32 / TPK;  // keys a warp takes at once
    constexpr int TAKE = KPW * UNROLL;  // keys a warp takes a round: UNROLL sets of KPW
    constexpr int STRIDE = WARPS * TAKE;
    constexpr int PER = D / 32;  // elements a lane holds in the warps' combine
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int slot = lane / TPK;
    const int sub = lane % TPK;
    // the grid: (cache row, key-value head) along x, spans along y, positions along z (read
    // from the grid, not from `length`: a load fewer to wait for before the keys' addresses)
    const int spans = SPLIT ? gridDim.y : 1;
    const int span = blockIdx.y;
    // b: the query row; POS query rows (a drafted row's positions) share cache row kv_row,
    // position p's keys ending POS - 1 - p before the last (a grid size, not a template
    // argument: each draft length would compile the kernel anew)
    const int POS = gridDim.z;
    const int kv_row = blockIdx.x / HKV;
    const int hk = blockIdx.x % HKV;
    const int b = kv_row * POS + blockIdx.z;
    const size_t capacity = (size_t)length[1];
    // never a slot after the buffer
    const int total = min(length[0] - (POS - 1 - (int)blockIdx.z), (int)capacity);
    const int first = min(max(starts[kv_row], 0), total);  // never a slot outside the keys
    // spans are counted from the row's first key, so padding never moves a key to another
    // span, and their size is the row's own: at least CHUNK keys, at most MAX_SPANS of them
    const int row_keys = total - first;
    const int per_span = max(CHUNK, ((row_keys + MAX_SPANS - 1) / MAX_SPANS + 31) / 32 * 32);
    const int lo = SPLIT ? first + span * per_span : first;
    const int hi = SPLIT ? min(lo + per_span, total) : total;
    const float softmax_scale = scale[0];
    // every row starts a multiple of 16 bytes past the buffers' start when they are aligned
    const bool wide = ((reinterpret_cast<size_t>(k) | reinterpret_cast<size_t>(v)) & 15) == 0;
    // base-2 scores: softmax(x) = 2^(x log2 e - max) / sum
    const float query_scale = softmax_scale * 1.4426950408889634f;

    // the GROUP query heads that read key-value head hk: each key and value is read once
    float qr[GROUP][VEC];
    const size_t first_head = (size_t)b * HQ + (size_t)hk * GROUP;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const InT* q_row = q + (first_head + g) * D + sub * VEC;
#pragma unroll
      for (int i = 0; i < VEC; ++i) qr[g][i] = static_cast<float>(q_row[i]) * query_scale;
    }
    const size_t head_base = ((size_t)kv_row * HKV + hk) * capacity * D + sub * VEC;
    const InT* k_head = k + head_base;
    const InT* v_head = v + head_base;

    // one maximum per query head for the whole warp; a sum and an output per key slot
    float m[GROUP];
    float l[GROUP];
    float acc[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      m[g] = -1e30f;
      l[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[g][i] = 0.0f;
    }
    // a round's keys (this lane's slot in each of the UNROLL sets, from t) into the running
    // sums; a key past the span holds zeros and weighs 0. Every score of the round is reduced
    // before any is used, so the UNROLL x GROUP shuffle chains overlap (one chain at a time
    // left the warps waiting on shuffles, ~23 us a layer for one row of 1,100 keys on an
    // H100). The maximum is the warp's over the round's keys, so the rescale is warp-uniform
    // and skipped when the maximum stays (a factor of exactly 1).
    auto take = [&](const float (*kc)[VEC], const float (*vc)[VEC], int t) {
      float s[UNROLL][GROUP];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          float d = 0.0f;
#pragma unroll
          for (int i = 0; i < VEC; ++i) d += qr[g][i] * kc[u][i];
          s[u][g] = d;
        }
#pragma unroll
      for (int o = TPK / 2; o > 0; o >>= 1)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
          for (int g = 0; g < GROUP; ++g) s[u][g] += __shfl_xor_sync(0xffffffff, s[u][g], o);
      float top[GROUP];
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        top[g] = -1e30f;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          if (t + u * KPW >= hi) s[u][g] = -1e30f;
          top[g] = fmaxf(top[g], s[u][g]);
        }
      }
#pragma unroll
      for (int o = TPK; o < 32; o <<= 1)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) top[g] = fmaxf(top[g], __shfl_xor_sync(0xffffffff, top[g], o));
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (top[g] > m[g]) {
          const float correction = rewind_exp2(m[g] - top[g]);
          l[g] *= correction;
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[g][i] *= correction;
          m[g] = top[g];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const float p = t + u * KPW < hi ? rewind_exp2(s[u][g] - m[g]) : 0.0f;
          l[g] += p;
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[g][i] += p * vc[u][i];
        }
      }
    };
    // warp w takes keys [lo + w * TAKE, + TAKE), then STRIDE further on, in that order; the
    // next round's keys load (into the other rows) while these are used
    auto run_keys = [&](auto wide_flag) {
      constexpr bool WIDE = decltype(wide_flag)::value;
      float ka[UNROLL][VEC], va[UNROLL][VEC], kb[UNROLL][VEC], vb[UNROLL][VEC];
      auto load = [&](float (*kd)[VEC], float (*vd)[VEC], int t) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int key = t + u * KPW;
          rewind_load_row<InT, VEC, WIDE>(k_head + (size_t)key * D, kd[u], key < hi);
          rewind_load_row<InT, VEC, WIDE>(v_head + (size_t)key * D, vd[u], key < hi);
        }
      };
      const int first_key = lo + warp * TAKE;
      load(ka, va, first_key + slot);
      for (int t0 = first_key; t0 < hi; t0 += 2 * STRIDE) {
        const int here = t0 + slot;
        const int next = here + STRIDE;
        load(kb, vb, next);
        take(ka, va, here);
        if (t0 + STRIDE >= hi) break;  // the same for the whole warp
        load(ka, va, next + STRIDE);
        take(kb, vb, next);
      }
    };
    if (wide) {
      run_keys(rewind_flag<true>{});
    } else {
      run_keys(rewind_flag<false>{});
    }
    // the key slots share the warp's maximum: their sums add (a butterfly, so every lane of a
    // slot ends with the same bits)
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int o = TPK; o < 32; o <<= 1) {
        l[g] += __shfl_xor_sync(0xffffffff, l[g], o);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] += __shfl_xor_sync(0xffffffff, acc[g][i], o);
      }
    }

    __shared__ float warp_m[WARPS * GROUP];
    __shared__ float warp_l[WARPS * GROUP];
    __shared__ float warp_acc[WARPS * GROUP * D];
    if (slot == 0) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        if (lane == 0) { warp_m[warp * GROUP + g] = m[g]; warp_l[warp * GROUP + g] = l[g]; }
#pragma unroll
        for (int i = 0; i < VEC; ++i) warp_acc[(warp * GROUP + g) * D + sub * VEC + i] = acc[g][i];
      }
    }
    __syncthreads();
    // warp g combines query head g's partial sums, warps in a fixed order
    for (int g = warp; g < GROUP; g += WARPS) {
      float top = -1e30f;
      for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w * GROUP + g]);
      float sum = 0.0f;
      float o[PER];
      for (int i = 0; i < PER; ++i) o[i] = 0.0f;
      for (int w = 0; w < WARPS; ++w) {
        const float wm = warp_m[w * GROUP + g];
        const float f = warp_l[w * GROUP + g] > 0.0f ? (wm == top ? 1.0f : rewind_exp2(wm - top)) : 0.0f;
        sum += warp_l[w * GROUP + g] * f;
        for (int i = 0; i < PER; ++i) o[i] += warp_acc[(w * GROUP + g) * D + lane * PER + i] * f;
      }
      WRITE
    }
"""
_SOURCE = _BODY.replace("WRITE", """const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      InT* out_row = out + (first_head + g) * D + lane * PER;
      for (int i = 0; i < PER; ++i) out_row[i] = static_cast<InT>(o[i] * inv);""")
# this span's sums, not yet divided: the combine weighs the spans as the warps were
_SPANS_SOURCE = _BODY.replace("WRITE", """
      const size_t at = (first_head + g) * spans + span;
      if (lane == 0) { part_m[at] = top; part_l[at] = sum; }
      for (int i = 0; i < PER; ++i) part_o[at * D + lane * PER + i] = o[i];""")
# One warp per (row, query head) joins the spans in order, with the block's own arithmetic: a
# row whose keys fit one span gets the single kernel's bits (its span's weight is exp(0) = 1,
# the empty spans' 0).
_COMBINE_SOURCE = """
    constexpr int PER = D / 32;
    const int lane = threadIdx.x & 31;
    const size_t head = blockIdx.x;
    const int spans = length[2];
    // up to 16 spans' loads issued at once (a loop over the run-time count waited on each)
    constexpr int CH = MAX_SPANS < 16 ? MAX_SPANS : 16;
    float top = -1e30f;
    for (int s0 = 0; s0 < spans; s0 += CH) {
      float pm[CH];
#pragma unroll
      for (int c = 0; c < CH; ++c) pm[c] = s0 + c < spans ? part_m[head * spans + s0 + c] : -1e30f;
#pragma unroll
      for (int c = 0; c < CH; ++c) top = fmaxf(top, pm[c]);
    }
    float sum = 0.0f;
    float o[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) o[i] = 0.0f;
    for (int s0 = 0; s0 < spans; s0 += CH) {
      float pm[CH], pl[CH], po[CH][PER];
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const bool in = s0 + c < spans;
        const size_t at = head * spans + s0 + c;
        pm[c] = in ? part_m[at] : -1e30f;
        pl[c] = in ? part_l[at] : 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) po[c][i] = in ? part_o[at * D + lane * PER + i] : 0.0f;
      }
      // the spans in order, as one loop over them would take them
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        if (s0 + c >= spans) break;
        const float f = pl[c] > 0.0f ? (pm[c] == top ? 1.0f : rewind_exp2(pm[c] - top)) : 0.0f;
        sum += pl[c] * f;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] += po[c][i] * f;
      }
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    OutT* out_row = out + head * D + lane * PER;
    for (int i = 0; i < PER; ++i) out_row[i] = static_cast<OutT>(o[i] * inv);
"""


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="rewind_decode_attention",
        input_names=["q", "k", "v", "starts", "length", "scale"], output_names=["out"],
        source=_SOURCE, header=_HEADER)


@functools.lru_cache(maxsize=None)
def _spans_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="rewind_decode_attention_spans",
        input_names=["q", "k", "v", "starts", "length", "scale"],
        output_names=["part_o", "part_m", "part_l"], source=_SPANS_SOURCE, header=_HEADER)


@functools.lru_cache(maxsize=None)
def _combine_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="rewind_decode_attention_combine",
        input_names=["part_o", "part_m", "part_l", "length"],
        output_names=["out"], source=_COMBINE_SOURCE, header=_HEADER)


# (dtype, head size, query heads, key-value heads) of each call this process made: warm_kernels
# builds every variant for each. MLX keeps no custom kernel on disk, and NVRTC took 1.6 s for
# the one-block kernel and 3.0 s for the spans and their combine at their first calls in a
# fresh process on an H100 (benchmarks/probes/first_steps.py).
_SEEN: set[tuple[Any, int, int, int]] = set()


def warm_kernels() -> int:
    """Run the one-block and the spanned kernel once for every head shape the process has
    called decode_attention with (a server's warm-up runs a short padded batch first, which
    calls the one-block kernel; a long context would otherwise build the spans' kernels inside
    a request). Outside mx.compile traces only. Returns the head shapes warmed."""
    if not available():
        return 0
    shapes = sorted(_SEEN, key=str)
    for dtype, dim, query_heads, kv_heads in shapes:
        queries = mx.zeros((1, query_heads, 1, dim), dtype)
        buffer = mx.zeros((1, kv_heads, 2 * KEYS_PER_SPAN, dim), dtype)
        for length in (KEYS_PER_SPAN, 2 * KEYS_PER_SPAN):
            mx.eval(decode_attention(queries, buffer, buffer, length, mx.zeros((1,), mx.int32),
                                     dim ** -0.5))
    return len(shapes)


def _elements_per_lane(dim: int, group: int) -> int:
    """Up to 8 (16 bytes of bf16) where D / that many lanes can share a key (D 32, 64, 128 or
    256), fewer for wide groups (a lane holds GROUP x it elements of the queries and as many of
    the outputs: 16 each where D allows, ~80 registers, three blocks an SM); a power of two, so
    that D / it lanes divide a warp (groups of 3 or 5 take 4 or 2); never under D / 32 (a whole
    warp a key). Llama-3.2-1B's groups of 4 at D 64: 4 elements, 0.245 ms at 32 rows of 4,096
    keys against 0.261 for 8 and 0.329 for 2 (H100, f1d3081). Qwen 3.5's 256-wide heads in
    groups up to 4 take 16 (two 16-byte loads a lane, two keys a warp; ptxas: ~230 registers, no
    spills, where groups of 8 spill): 32 rows of 4,096 keys 0.179 ms against 0.267 for 8, one row
    of 32,768 0.066 against 0.091 (H100, 74c6449, benchmarks/probes/sdpa_mask_cost.py)."""
    if dim not in (32, 64, 128, 256):
        return dim // 32
    if dim == 256 and group <= 4:
        return 16
    wanted = max(1, min(8, 16 // group))
    return max(dim // 32, 1 << (wanted.bit_length() - 1))


def _unroll(dim: int, group: int, vec: int) -> int:
    """4, 2 or 1 sets of keys a round: the most whose registers fit _ROUND_FLOATS (two rounds'
    keys and values in flight, the group's queries and outputs, the round's scores)."""
    for sets in (4, 2):
        if 4 * sets * vec + 2 * group * vec + sets * group <= _ROUND_FLOATS:
            return sets
    return 1


def _lanes_fit(dim: int, vec: int) -> bool:
    """Whether D / vec lanes share a key within a warp (the kernel's layout)."""
    return vec >= 1 and dim % vec == 0 and 32 % (dim // vec) == 0


def _partials_bytes(group: int, dim: int, warps: int = WARPS) -> int:
    """Shared memory for the warps' partial sums: an output, a maximum and a sum per head."""
    return 4 * warps * group * (dim + 2)


def available() -> bool:
    return on_cuda()


def decode_attention(queries: mx.array, key_buffer: mx.array, value_buffer: mx.array,
                     length: int | mx.array, starts: mx.array, scale: float,
                     keys_per_span: int = KEYS_PER_SPAN,
                     elements_per_lane: int | None = ELEMENTS_PER_LANE,
                     max_spans: int = MAX_SPANS,
                     unroll: int | None = UNROLL,
                     warps: int = WARPS,
                     bounds_memo: dict[tuple[int, int, int], mx.array] | None = None
                     ) -> mx.array:
    """softmax(scale * q @ k^T) @ v over keys [starts[b], length) of each row b.

    queries [B, Hq, P, D]; key_buffer / value_buffer [B, Hkv, capacity, D] with capacity >=
    length; starts [B] integers. Position p of P (the last P tokens of a row, a drafted row's
    check) takes keys [starts[b], length - (P - 1 - p)), each position as a row of its own: its
    bits are those of a one-token call at that length. `length` may be a one-element array (a
    compiled step keeps it on the device; the kernel clamps it to the capacity), and then
    `bounds_memo` a dict the layers of one step share, so that they share the kernel's bounds
    array too. Raises ValueError for shapes the kernel does not take."""
    batch, query_heads, positions, dim = queries.shape
    if not 1 <= positions <= MAX_POSITIONS:
        raise ValueError(f"1 to {MAX_POSITIONS} query tokens per row, got {positions}")
    if key_buffer.shape != value_buffer.shape or key_buffer.ndim != 4:
        raise ValueError(f"keys {key_buffer.shape} and values {value_buffer.shape} differ")
    kv_batch, kv_heads, capacity, kv_dim = key_buffer.shape
    if kv_batch != batch or kv_dim != dim or query_heads % kv_heads:
        raise ValueError(f"queries {queries.shape} do not fit keys {key_buffer.shape}")
    if dim % 32 or dim > 256:
        raise ValueError(f"head size {dim}: a multiple of 32 up to 256")
    if warps not in (2, 4, 8):
        raise ValueError(f"warps {warps}: 2, 4 or 8 a block")
    if _partials_bytes(query_heads // kv_heads, dim, warps) > _SHARED_BYTES:
        raise ValueError(f"{query_heads // kv_heads} query heads per key-value head of size "
                         f"{dim}: the warps' partial sums outgrow a block's shared memory")
    if starts.shape != (batch,):
        raise ValueError(f"starts {starts.shape} for {batch} rows")
    if keys_per_span < 32 or keys_per_span % warps:
        raise ValueError(f"keys_per_span {keys_per_span}: a multiple of {warps}, at least 32")
    if not 1 <= max_spans <= _MAX_GRID_Y:
        raise ValueError(f"max_spans {max_spans}: 1 to {_MAX_GRID_Y} (spans are the grid's y)")
    vec = (_elements_per_lane(dim, query_heads // kv_heads) if elements_per_lane is None
           else elements_per_lane)
    if not _lanes_fit(dim, vec):
        raise ValueError(f"elements_per_lane {vec}: D / it lanes must share a key, a divisor "
                         f"of 32 (D = {dim})")
    sets = _unroll(dim, query_heads // kv_heads, vec) if unroll is None else unroll
    if sets not in (1, 2, 4, 8):
        raise ValueError(f"unroll {sets}: 1, 2, 4 or 8 sets of keys a round")
    if isinstance(length, mx.array):
        if length.size != 1:
            raise ValueError(f"length: one element, got shape {length.shape}")
        # the grid is fixed when the call is made: spans for the whole buffer (those past a
        # row's last key find nothing and weigh 0). A row needs at most ceil(its keys /
        # keys_per_span) spans and at most max_spans.
        spans = min(max_spans, -(-capacity // keys_per_span))
        memo = {} if bounds_memo is None else bounds_memo
        bounds = memo.get((capacity, spans, positions))
        if bounds is None:
            bounds = memo[(capacity, spans, positions)] = mx.concatenate(
                [length.reshape(1).astype(mx.int32),
                 mx.array([capacity, spans, positions], mx.int32)])
    elif positions <= length <= capacity:
        spans = min(max_spans, -(-length // keys_per_span))
        bounds = mx.array([length, capacity, spans, positions], mx.int32)  # a small upload
    else:
        raise ValueError(f"length {length} of capacity {capacity}")
    dtype = queries.dtype
    _SEEN.add((dtype, dim, query_heads, kv_heads))
    if positions > 1:  # one query row per position: [B * P, Hq, 1, D]
        queries = queries.transpose(0, 2, 1, 3).reshape(batch * positions, query_heads, 1, dim)
    inputs = [queries, key_buffer.astype(dtype), value_buffer.astype(dtype),
              starts.astype(mx.int32), bounds, constant_floats(scale)]
    # the capacity and the span count are inputs, not template arguments: buffers grow along a
    # ladder, and each template value compiles the kernel anew
    template = [("InT", dtype), ("D", dim), ("HQ", query_heads), ("HKV", kv_heads),
                ("GROUP", query_heads // kv_heads), ("WARPS", warps), ("CHUNK", keys_per_span),
                ("MAX_SPANS", max_spans), ("VEC", vec), ("UNROLL", sets)]
    threads = 32 * warps
    rows = batch * positions
    if spans == 1:
        out = _kernel()(
            inputs=inputs, template=template + [("SPLIT", 0)],
            grid=(batch * kv_heads * threads, 1, positions), threadgroup=(threads, 1, 1),
            output_shapes=[queries.shape], output_dtypes=[dtype])[0]
    else:
        heads = rows * query_heads
        part_o, part_m, part_l = _spans_kernel()(
            inputs=inputs, template=template + [("SPLIT", 1)],
            grid=(batch * kv_heads * threads, spans, positions), threadgroup=(threads, 1, 1),
            output_shapes=[(heads, spans, dim), (heads, spans), (heads, spans)],
            output_dtypes=[mx.float32] * 3)
        out = _combine_kernel()(
            inputs=[part_o, part_m, part_l, bounds],
            template=[("OutT", dtype), ("D", dim), ("MAX_SPANS", max_spans)],
            grid=(heads * 32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[queries.shape], output_dtypes=[dtype])[0]
    if positions == 1:
        return out
    return out.reshape(batch, positions, query_heads, dim).transpose(0, 2, 1, 3)


def _padded_layout(cache: Any, keys: mx.array, mask: Any) -> tuple[int, mx.array] | None:
    """(length, starts) where this call is a decode step of a left-padded batch cache and its
    mask says only "row b's keys start at left_padding[b]"; None otherwise. The cache class
    says which masks those are (rewind.cache.kv.GrowingBatchKVCache.left_padding_only: a
    model makes one mask, from its first layer's cache, for all its layers, and the rows of
    every layer's cache share their padding)."""
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        return None
    says = getattr(cache, "left_padding_only", None)
    if says is None or not says(mask):
        return None
    starts = getattr(cache, "left_padding", None)
    length = getattr(cache, "_idx", None)
    buffer, value_buffer = getattr(cache, "keys", None), getattr(cache, "values", None)
    if (not isinstance(starts, mx.array) or not isinstance(length, int) or buffer is None
            or value_buffer is None or getattr(cache, "lengths", None) is not None
            or keys.shape[2] != length or buffer.shape[:2] != keys.shape[:2]
            or mask.shape != (keys.shape[0], 1, 1, length)):
        return None
    return length, starts


def _lone_row(queries: mx.array, keys: mx.array, cache: Any, mask: Any) -> bool:
    """Whether this call is one row's (a batch-1 cache holding every key it has seen, no
    padding) decode step (one position, no mask), or inside cuda_rows.rows_alone a drafted
    row's check (up to cuda_rows.MAX_ROWS positions, causal): positions the kernel computes
    each alone, with the bits of one-token steps."""
    positions = queries.shape[2]
    if positions == 1:
        if mask is not None:
            return False
    elif not (isinstance(mask, str) and mask == "causal" and positions <= cuda_rows.MAX_ROWS
              and cuda_rows.rows_alone_on()):
        return False
    tokens = getattr(cache, "offset", None)
    return (getattr(cache, "ladder_rows", None) is not None and isinstance(tokens, int)
            and cache.keys is not None and cache.values is not None
            and cache.keys.shape[0] == 1 == queries.shape[0] and keys.shape[2] == tokens
            and positions <= tokens <= cache.keys.shape[2])


def kernel_takes_heads(query_heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel computes heads of this shape (bf16/fp16 buffers aside)."""
    group = query_heads // kv_heads
    return (dim % 32 == 0 and dim <= 256 and query_heads % kv_heads == 0
            and _lanes_fit(dim, _elements_per_lane(dim, group))
            and _partials_bytes(group, dim) <= _SHARED_BYTES)


def _kernel_takes(queries: mx.array, cache: Any) -> bool:
    """Shapes and types the kernel computes as they are: one head size for queries, keys and
    values (DeepSeek-V2-like layers have wider keys than values), whole groups of query heads
    per key-value head, keys and values already in the queries' dtype (a cast would copy the
    whole buffer every layer and step)."""
    keys, values = cache.keys, cache.values
    dim = queries.shape[-1]
    return (keys.shape == values.shape and keys.shape[-1] == dim and dim % 32 == 0
            and dim <= 256 and queries.shape[1] % keys.shape[1] == 0
            and _lanes_fit(dim, _elements_per_lane(dim, queries.shape[1] // keys.shape[1]))
            and _partials_bytes(queries.shape[1] // keys.shape[1], dim) <= _SHARED_BYTES
            and keys.dtype == queries.dtype == values.dtype)


def _attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
               mask: Any, sinks: Any = None) -> mx.array:
    """mlx_lm.models.base.scaled_dot_product_attention with the kernel where it applies."""
    from mlx_lm.models import base

    if hasattr(cache, "bits"):
        return _dequantized_attention(queries, keys, values, cache, scale, mask, sinks)
    if sinks is None and not env.cuda_attention_off():
        if (queries.shape[2] == 1 and getattr(cache, "fixed_capacity", False)
                and _kernel_takes(queries, cache)):
            # a compiled decode step's view (rewind.engine.compiled_decode): the whole buffer,
            # its length on the device
            return decode_attention(queries, cache.keys, cache.values, cache.filled(),
                                    cache.starts, scale, bounds_memo=cache.shared.bounds)
        layout = _padded_layout(cache, keys, mask) if queries.shape[2] == 1 else None
        if layout is not None and _kernel_takes(queries, cache):
            length, starts = layout
            return decode_attention(queries, cache.keys, cache.values, length, starts, scale)
        if _lone_row(queries, keys, cache, mask) and _kernel_takes(queries, cache):
            # one row's cache: a decode step, or a drafted row's check (its positions alone)
            return decode_attention(queries, cache.keys, cache.values, cache.offset,
                                    mx.zeros((1,), mx.int32), scale)
    if queries.shape[2] > 1 and cuda_rows.rows_alone_on():
        cuda_rows.missed(f"attention over {queries.shape[2]} positions")
    if queries.shape[2] > 1 and prompt_shapes.takes(cache, keys, mask, sinks):
        return prompt_shapes.attention(queries, cache, scale)
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                             mask=mask, sinks=sinks)


def _dequantized_attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                           mask: Any, sinks: Any) -> mx.array:
    """Attention over a quantized KV cache (mlx-lm's QuantizedKVCache: `rewind generate
    --kv-bits`) through the dequantized keys and values. mlx-lm's own path multiplies by the
    packed keys with `mx.quantized_matmul`, which MLX 0.32's CUDA backend refuses for most key
    counts ("No implementation for problem shape: 180x180x64x4"); the dequantized buffers cost
    one layer's keys and values in the queries' dtype for the length of the call, and the
    cache keeps its packed form."""
    keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
    values = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(queries.dtype), values.astype(queries.dtype), scale=scale,
        mask=mask, sinks=sinks)


def use_in_model(model: Any) -> int:
    """Route `model`'s attention modules through `_attention` (rewind.kernels.rebind: this
    model's modules only); returns how many were changed."""
    from mlx_lm.models import base

    from rewind.kernels.rebind import swap_function

    return swap_function(model, "scaled_dot_product_attention", base.scaled_dot_product_attention,
                         _attention)
