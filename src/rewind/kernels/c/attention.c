/* Attention on the CPU: softmax(scale * q k^T + mask) v for one layer, as
   mx.fast.scaled_dot_product_attention defines it, for float32 queries and float32 or bf16
   keys/values read in place from the KV cache.

   Why: MLX's CPU backend runs attention as separate ops over a materialized [L, S] score
   matrix with a scalar exp (11-23 ns an element here): a 512-token chunk at 8.7k tokens of
   context took 287 ms per global layer of Gemma 3 270M, more than all its matmuls. This kernel
   streams keys in blocks with an online softmax (flash-attention style), a vectorized exp, and
   skips blocks the mask rules out (the causal upper triangle; windows and padding from mask
   arrays), over a thread pool (pool.c).

   Grouped-query attention: the `heads / kv_heads` query heads that share a key/value head are
   one work item, so each key block is read once for all of them. A work item is (batch row,
   kv head, block of query positions, key range); with few items (decode: one query position)
   the keys are split into ranges whose partial softmax sums are combined at the end.

   Masks: none, causal (aligned to the last key, as MLX's "causal"), a boolean array (false =
   masked, as MLX's where(mask, scores, finfo.min)) or an additive float array, each with
   broadcast strides. A row that every key masks gets the mean of the values, as MLX's
   finfo.min fill gives. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

enum { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_BOOL = 2, MASK_ADD = 3 };

typedef struct {
  const float *q;              /* [B, heads, L, D] */
  const void *k, *v;           /* [B, kv_heads, S, D], kv_form */
  int64_t qs[4], ks[4], vs[4]; /* element strides; the last is 1 */
  const void *mask;            /* [B, heads, L, S] with broadcast strides, or NULL */
  int64_t ms[4];
  int64_t mask_kind;
  float *out; /* [B, heads, L, D], strides os (the last is 1) */
  int64_t os[4];
  int64_t B, heads, kv_heads, L, S, D;
  float scale;
  int64_t kv_form; /* FORM_F32 or FORM_BF16 */
  int64_t threads;
} Attention;

#define KB 64       /* keys per block */
#define ROWS_MAX 32 /* query rows (positions x heads of one group) per work item */
#define SPLIT_MIN 256 /* keys per split at least */

typedef struct {
  const Attention *a;
  int64_t rep, per_block, qblocks, splits, rows_max;
  float *part_m, *part_l, *part_acc; /* per (item, row) when splits > 1 */
  uint8_t *written;                  /* per output row: some key was seen */
  _Atomic int failed;                /* a work item could not get its scratch */
} Plan;

static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

static inline const void *kv_at(const void *base, int form, const int64_t *st, int64_t b,
                                int64_t g, int64_t j) {
  int64_t off = b * st[0] + g * st[1] + j * st[2];
  return form == FORM_BF16 ? (const void *)((const uint16_t *)base + off)
                           : (const void *)((const float *)base + off);
}

static inline vf kv_load(const void *row, int form, int64_t d) {
  return form == FORM_BF16 ? ld_bf16((const uint16_t *)row + d) : LDF((const float *)row + d);
}

/* s[r][j] = q[r] . k[j] for rows [0, rows_pad) and keys [0, n) of the block (keys past n
   repeat the last one and are not stored). */
static void block_scores(const float *q, const void *const *keys, int form, int64_t rows_pad,
                         int64_t n, int64_t D, float *s) {
  for (int64_t r = 0; r < rows_pad; r += 4) {
    for (int64_t j = 0; j < n; j += 4) {
      const void *kr[4];
      for (int t = 0; t < 4; ++t) kr[t] = keys[min64(j + t, n - 1)];
      vf acc[4][4];
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4; ++t) acc[i][t] = ZERO();
      for (int64_t d = 0; d < D; d += VW) {
        vf kv[4];
        for (int t = 0; t < 4; ++t) kv[t] = kv_load(kr[t], form, d);
        for (int i = 0; i < 4; ++i) {
          vf qv = LDF(q + (r + i) * D + d);
          for (int t = 0; t < 4; ++t) acc[i][t] = FMA(qv, kv[t], acc[i][t]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4 && j + t < n; ++t) s[(r + i) * KB + j + t] = hsum(acc[i][t]);
    }
  }
}

/* acc[r] += sum_j p[r][j] v[j] for rows [0, rows_pad), keys [0, n). */
static void block_values(const float *p, const void *const *values, int form, int64_t rows_pad,
                         int64_t n, int64_t D, float *acc) {
  const int64_t wide = 4 * VW;
  int64_t d0 = 0;
  for (; d0 + wide <= D; d0 += wide) {
    for (int64_t r = 0; r < rows_pad; r += 4) {
      vf o[4][4];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) o[i][c] = LDF(acc + (r + i) * D + d0 + c * VW);
      for (int64_t j = 0; j < n; ++j) {
        vf vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = kv_load(values[j], form, d0 + c * VW);
        for (int i = 0; i < 4; ++i) {
          vf pb = SET1(p[(r + i) * KB + j]);
          for (int c = 0; c < 4; ++c) o[i][c] = FMA(pb, vv[c], o[i][c]);
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) STF(acc + (r + i) * D + d0 + c * VW, o[i][c]);
    }
  }
  for (; d0 < D; d0 += VW) {
    for (int64_t r = 0; r < rows_pad; r += 4) {
      vf o[4];
      for (int i = 0; i < 4; ++i) o[i] = LDF(acc + (r + i) * D + d0);
      for (int64_t j = 0; j < n; ++j) {
        vf vv = kv_load(values[j], form, d0);
        for (int i = 0; i < 4; ++i) o[i] = FMA(SET1(p[(r + i) * KB + j]), vv, o[i]);
      }
      for (int i = 0; i < 4; ++i) STF(acc + (r + i) * D + d0, o[i]);
    }
  }
}

static inline int mask_allows(const Attention *a, int64_t b, int64_t head, int64_t i, int64_t j) {
  const int64_t *ms = a->ms;
  return ((const uint8_t *)a->mask)[b * ms[0] + head * ms[1] + i * ms[2] + j * ms[3]] != 0;
}

static void attention_item(const void *arg, int64_t item) {
  const Plan *plan = (const Plan *)arg;
  const Attention *a = plan->a;
  const int64_t D = a->D, rep = plan->rep, L = a->L, S = a->S;
  const int form = (int)a->kv_form;
  int64_t split = item % plan->splits, rest = item / plan->splits;
  int64_t qb = rest % plan->qblocks, bg = rest / plan->qblocks;
  int64_t g = bg % a->kv_heads, b = bg / a->kv_heads;
  int64_t q0 = qb * plan->per_block, nq = min64(plan->per_block, L - q0);
  int64_t rows = nq * rep, rows_pad = (rows + 3) & ~(int64_t)3;

  /* Keys this item can see: causal rules out keys past the block's last position. */
  int64_t kend = S;
  if (a->mask_kind == MASK_CAUSAL) kend = min64(S, q0 + nq - 1 + (S - L) + 1);
  int64_t span = (kend + plan->splits - 1) / plan->splits;
  span = (span + KB - 1) / KB * KB;
  int64_t k_lo = min64(kend, split * span), k_hi = min64(kend, k_lo + span);

  /* aligned_alloc takes a size that is a multiple of the alignment (C11; ASan enforces it). */
  size_t bytes = (size_t)(rows_pad * D * 2 + rows_pad * KB + rows_pad * 3) * 4;
  float *q = aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!q) { /* out of memory: the caller reports it, nothing is written */
    atomic_store_explicit((_Atomic int *)&plan->failed, 1, memory_order_relaxed);
    return;
  }
  float *acc = q + rows_pad * D, *s = acc + rows_pad * D, *m = s + rows_pad * KB;
  float *l = m + rows_pad, *seen = l + rows_pad;
  memset(q, 0, (size_t)(rows_pad * D * 2) * 4);
  for (int64_t r = 0; r < rows_pad; ++r) { m[r] = -INFINITY; l[r] = 0.f; seen[r] = 0.f; }
  for (int64_t r = 0; r < rows; ++r) {
    int64_t i = q0 + r / rep, head = g * rep + r % rep;
    const float *src = a->q + b * a->qs[0] + head * a->qs[1] + i * a->qs[2];
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = src[d] * a->scale;
  }

  const void *keys[KB], *values[KB];
  for (int64_t j0 = k_lo; j0 < k_hi; j0 += KB) {
    int64_t n = min64(KB, k_hi - j0);
    if (a->mask_kind == MASK_BOOL) { /* skip a block no row may see */
      int any = 0;
      for (int64_t r = 0; r < rows && !any; ++r)
        for (int64_t j = 0; j < n && !any; ++j)
          any = mask_allows(a, b, g * rep + r % rep, q0 + r / rep, j0 + j);
      if (!any) continue;
    }
    for (int64_t j = 0; j < n; ++j) {
      keys[j] = kv_at(a->k, form, a->ks, b, g, j0 + j);
      values[j] = kv_at(a->v, form, a->vs, b, g, j0 + j);
    }
    block_scores(q, keys, form, rows_pad, n, D, s);
    for (int64_t r = 0; r < rows_pad; ++r) {
      float *sr = s + r * KB;
      if (r >= rows) { memset(sr, 0, KB * sizeof(float)); continue; }
      int64_t i = q0 + r / rep, head = g * rep + r % rep;
      if (a->mask_kind == MASK_CAUSAL) {
        int64_t limit = i + (S - L);
        for (int64_t j = 0; j < n; ++j)
          if (j0 + j > limit) sr[j] = -INFINITY;
      } else if (a->mask_kind == MASK_BOOL) {
        for (int64_t j = 0; j < n; ++j)
          if (!mask_allows(a, b, head, i, j0 + j)) sr[j] = -INFINITY;
      } else if (a->mask_kind == MASK_ADD) {
        const int64_t *ms = a->ms;
        const float *mr = (const float *)a->mask + b * ms[0] + head * ms[1] + i * ms[2];
        for (int64_t j = 0; j < n; ++j) sr[j] += mr[(j0 + j) * ms[3]];
      }
      float best = -INFINITY;
      for (int64_t j = 0; j < n; ++j) best = sr[j] > best ? sr[j] : best;
      if (best == -INFINITY) { memset(sr, 0, KB * sizeof(float)); continue; }
      float m_new = best > m[r] ? best : m[r];
      float corr = expf(m[r] - m_new); /* 0 while nothing was seen */
      float sum = 0.f;
      int64_t j = 0;
      vf vm = SET1(m_new), vs = ZERO();
      for (; j + VW <= n; j += VW) {
        vf e = vexp(SUB(LDF(sr + j), vm));
        STF(sr + j, e);
        vs = ADD(vs, e);
      }
      sum = hsum(vs);
      for (; j < n; ++j) { sr[j] = expf(sr[j] - m_new); sum += sr[j]; }
      for (j = n; j < KB; ++j) sr[j] = 0.f;
      if (corr != 1.0f) {
        float *ar = acc + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
      seen[r] = 1.f;
    }
    block_values(s, values, form, rows_pad, n, D, acc);
  }

  if (plan->splits > 1) {
    int64_t base = item * plan->rows_max;
    for (int64_t r = 0; r < rows; ++r) {
      plan->part_m[base + r] = seen[r] != 0.f ? m[r] : -INFINITY;
      plan->part_l[base + r] = l[r];
      memcpy(plan->part_acc + (base + r) * D, acc + r * D, (size_t)D * 4);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      int64_t i = q0 + r / rep, head = g * rep + r % rep;
      float *dst = a->out + b * a->os[0] + head * a->os[1] + i * a->os[2];
      if (seen[r] == 0.f) continue; /* every key masked: the caller fills it */
      plan->written[(b * a->heads + head) * L + i] = 1;
      float inv = 1.0f / l[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
    }
  }
  free(q);
}

/* The mean of the values: MLX's answer for a row whose every key is masked. */
static void mean_values(const Attention *a, int64_t b, int64_t g, float *dst) {
  for (int64_t d = 0; d < a->D; ++d) dst[d] = 0.f;
  for (int64_t j = 0; j < a->S; ++j) {
    const void *row = kv_at(a->v, (int)a->kv_form, a->vs, b, g, j);
    for (int64_t d = 0; d < a->D; ++d)
      dst[d] += a->kv_form == FORM_BF16 ? weight_at(row, FORM_BF16, d) : ((const float *)row)[d];
  }
  for (int64_t d = 0; d < a->D; ++d) dst[d] /= (float)a->S;
}

/* Returns 0, -1 for shapes it does not take (the caller then uses MLX's attention), or -2 when
   memory for its scratch ran out (nothing usable was written). */
int attention(const Attention *a) {
  if (a->B < 1 || a->L < 1 || a->S < 1 || a->kv_heads < 1 || a->heads % a->kv_heads ||
      a->D % VW || a->qs[3] != 1 || a->ks[3] != 1 || a->vs[3] != 1 || a->os[3] != 1 ||
      (a->kv_form != FORM_F32 && a->kv_form != FORM_BF16))
    return -1;
  Plan plan = {.a = a, .rep = a->heads / a->kv_heads};
  plan.per_block = plan.rep >= ROWS_MAX ? 1 : ROWS_MAX / plan.rep;
  if (plan.per_block > a->L) plan.per_block = a->L;
  plan.qblocks = (a->L + plan.per_block - 1) / plan.per_block;
  plan.rows_max = plan.per_block * plan.rep;
  int64_t items = a->B * a->kv_heads * plan.qblocks, threads = a->threads < 1 ? 1 : a->threads;
  plan.splits = 1;
  if (items < 2 * threads && a->S >= 2 * SPLIT_MIN) {
    plan.splits = (2 * threads + items - 1) / items;
    if (plan.splits > a->S / SPLIT_MIN) plan.splits = a->S / SPLIT_MIN;
  }
  int64_t total = items * plan.splits;
  if (plan.splits > 1) {
    plan.part_m = malloc((size_t)(total * plan.rows_max * (2 + a->D)) * 4);
    if (!plan.part_m) return -2;
    plan.part_l = plan.part_m + total * plan.rows_max;
    plan.part_acc = plan.part_l + total * plan.rows_max;
  }
  plan.written = calloc((size_t)(a->B * a->heads * a->L), 1);
  if (!plan.written) { free(plan.part_m); return -2; }
  run_blocks(attention_item, &plan, total, (int)threads);
  if (atomic_load_explicit(&plan.failed, memory_order_relaxed)) {
    free(plan.part_m);
    free(plan.written);
    return -2;
  }

  if (plan.splits > 1) {
    for (int64_t it = 0; it < items; ++it) {
      int64_t qb = it % plan.qblocks, bg = it / plan.qblocks;
      int64_t g = bg % a->kv_heads, b = bg / a->kv_heads;
      int64_t q0 = qb * plan.per_block, nq = min64(plan.per_block, a->L - q0);
      for (int64_t r = 0; r < nq * plan.rep; ++r) {
        int64_t i = q0 + r / plan.rep, head = g * plan.rep + r % plan.rep;
        float *dst = a->out + b * a->os[0] + head * a->os[1] + i * a->os[2];
        float best = -INFINITY;
        for (int64_t sp = 0; sp < plan.splits; ++sp) {
          float mv = plan.part_m[(it * plan.splits + sp) * plan.rows_max + r];
          best = mv > best ? mv : best;
        }
        if (best == -INFINITY) continue;
        plan.written[(b * a->heads + head) * a->L + i] = 1;
        float total_l = 0.f;
        for (int64_t d = 0; d < a->D; ++d) dst[d] = 0.f;
        for (int64_t sp = 0; sp < plan.splits; ++sp) {
          int64_t at = (it * plan.splits + sp) * plan.rows_max + r;
          if (plan.part_m[at] == -INFINITY) continue;
          float w = expf(plan.part_m[at] - best);
          total_l += plan.part_l[at] * w;
          const float *pa = plan.part_acc + at * a->D;
          for (int64_t d = 0; d < a->D; ++d) dst[d] += pa[d] * w;
        }
        float inv = 1.0f / total_l;
        for (int64_t d = 0; d < a->D; ++d) dst[d] *= inv;
      }
    }
    free(plan.part_m);
  }
  for (int64_t bh = 0; bh < a->B * a->heads; ++bh)
    for (int64_t i = 0; i < a->L; ++i) {
      if (!plan.written[bh * a->L + i])
        mean_values(a, bh / a->heads, (bh % a->heads) / plan.rep,
                    a->out + (bh / a->heads) * a->os[0] + (bh % a->heads) * a->os[1] + i * a->os[2]);
    }
  free(plan.written);
  return 0;
}
