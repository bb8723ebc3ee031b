/* The gated delta rule (Qwen 3.5 and Qwen3-Next's linear attention layers) on the CPU, as
   mlx-lm's gated_delta_ops computes it, for float32 inputs and state.

   Why: mlx-lm has a Metal kernel for it and nothing else; on the CPU (and CUDA) it falls back to
   a Python loop that builds and runs a small graph per token per layer. On a Qwen 3.5 0.8B-sized
   model that loop was about half of a prefill's time on 2 cores. Here each (batch row, value
   head) is one work item over the thread pool (pool.c), its [Dv, Dk] state stays in
   cache for the whole chunk, and each step reads and writes every state row once:

     S = S * g                      (g a scalar per head, or a vector over Dk)
     kv = S k;  delta = (v - kv) * beta;  S = S + delta k^T;  y = S q

   Grouped heads: value head h reads query/key head h / (Hv / Hk), as mx.repeat lays them out.
   A masked step (a padding position, mask 0) leaves the state as it was; its output is what
   the ops give there (the updated state times q), which nothing reads. */
#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef struct {
  const float *q, *k;   /* [B, T, Hk, Dk] */
  const float *v;       /* [B, T, Hv, Dv] */
  const float *g;       /* [B, T, Hv], or [B, T, Hv, Dk] when g_per_key */
  const float *beta;    /* [B, T, Hv] */
  const uint8_t *mask;  /* [B, T], nonzero = a real token; NULL = all real */
  float *state;         /* [B, Hv, Dv, Dk], read and updated in place */
  float *y;             /* [B, T, Hv, Dv] */
  int64_t B, T, Hk, Hv, Dk, Dv, g_per_key, threads;
} GatedDelta;

/* One row of the state: decay it and return its dot with k. */
static inline float decay_dot(float *s, const float *g, float g1, const float *k, int64_t n) {
  int64_t j = 0;
  vf acc = ZERO();
  if (g) {
    for (; j + VW <= n; j += VW) {
      vf row = MUL(LDF(s + j), LDF(g + j));
      STF(s + j, row);
      acc = FMA(row, LDF(k + j), acc);
    }
  } else {
    vf gv = SET1(g1);
    for (; j + VW <= n; j += VW) {
      vf row = MUL(LDF(s + j), gv);
      STF(s + j, row);
      acc = FMA(row, LDF(k + j), acc);
    }
  }
  float total = hsum(acc);
  for (; j < n; j++) {
    s[j] *= g ? g[j] : g1;
    total += s[j] * k[j];
  }
  return total;
}

/* s += d * k; return s . q */
static inline float update_dot(float *s, float d, const float *k, const float *q, int64_t n) {
  int64_t j = 0;
  vf dv = SET1(d), acc = ZERO();
  for (; j + VW <= n; j += VW) {
    vf row = FMA(dv, LDF(k + j), LDF(s + j));
    STF(s + j, row);
    acc = FMA(row, LDF(q + j), acc);
  }
  float total = hsum(acc);
  for (; j < n; j++) {
    s[j] += d * k[j];
    total += s[j] * q[j];
  }
  return total;
}

static void gated_delta_block(const void *args, int64_t block) {
  const GatedDelta *a = (const GatedDelta *)args;
  const int64_t b = block / a->Hv, h = block % a->Hv, hk = h / (a->Hv / a->Hk);
  const int64_t Dk = a->Dk, Dv = a->Dv;
  float *state = a->state + block * Dv * Dk;
  float saved_row[Dk > 0 ? Dk : 1];
  for (int64_t t = 0; t < a->T; t++) {
    const int64_t bt = b * a->T + t;
    const float *q = a->q + (bt * a->Hk + hk) * Dk;
    const float *k = a->k + (bt * a->Hk + hk) * Dk;
    const float *v = a->v + (bt * a->Hv + h) * Dv;
    const float *g = a->g_per_key ? a->g + (bt * a->Hv + h) * Dk : NULL;
    const float g1 = a->g_per_key ? 0.0f : a->g[bt * a->Hv + h];
    const float beta = a->beta[bt * a->Hv + h];
    const int keep = a->mask == NULL || a->mask[bt] != 0;
    float *y = a->y + (bt * a->Hv + h) * Dv;
    for (int64_t i = 0; i < Dv; i++) {
      float *s = state + i * Dk;
      if (!keep) memcpy(saved_row, s, (size_t)Dk * sizeof(float));
      const float kv = decay_dot(s, g, g1, k, Dk);
      y[i] = update_dot(s, (v[i] - kv) * beta, k, q, Dk);
      if (!keep) memcpy(s, saved_row, (size_t)Dk * sizeof(float));
    }
  }
}

int gated_delta(const GatedDelta *a) {
  if (a->Hk <= 0 || a->Hv % a->Hk != 0 || a->Dk <= 0 || a->Dv <= 0) return 1;
  run_blocks(gated_delta_block, a, a->B * a->Hv, (int)a->threads);
  return 0;
}
