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
   kv head, block of query positions, range of spans); with few items (decode: one query
   position) the spans are split over several items and merged at the end.

   Same bits however the work came: keys are visited in order of absolute position (a sliding
   window's ring buffer is read from its oldest key), in blocks at multiples of KB, and every
   SPAN of positions is its own partial softmax, merged into the row in span order by one
   function. So a row's output does not depend on the chunk it came in, on whether it was a
   decode step or part of a prefill, on the other rows of the call or on the thread count. The
   GGUF block kernels quantize activations to int8, which turns any rounding difference into a
   different answer: this is what lets a cached, chunked or batched run give the uncached one's.

   Masks: none, causal (aligned to the last key, as MLX's "causal"), a boolean array (false =
   masked, as MLX's where(mask, scores, finfo.min)) or an additive float array, each with
   broadcast strides. A row that every key masks gets the mean of the values, as MLX's
   finfo.min fill gives. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "simd.h"


#define KB 64       /* keys per block */
#define ROWS_MAX 32 /* query rows (positions x heads of one group) per work item */
#define SPAN 256    /* positions per partial softmax; a multiple of KB */

typedef struct {
  const Attention *a;
  int64_t rep, per_block, qblocks, rows_max;
  int64_t spans;     /* spans of SPAN positions the widest batch row's keys touch */
  int64_t splits;    /* work items per (batch row, kv head, query block) */
  int64_t per_split; /* spans per split */
  float *part;       /* when splits > 1: per (group, span, row) m, l and acc[D] */
  uint8_t *written;  /* per output row: some key was seen */
  _Atomic int failed; /* a work item could not get its scratch */
} Plan;

static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

static inline const void *kv_at(const void *base, int form, const int64_t *st, int64_t b,
                                int64_t g, int64_t j) {
  int64_t off = b * st[0] + g * st[1] + j * st[2];
  return form == FORM_BF16 ? (const void *)((const uint16_t *)base + off)
                           : (const void *)((const float *)base + off);
}

/* Logical key t of row b, kv head g (t = 0 the oldest): from the tail or the cache's buffer. */
static inline const void *key_row(const Attention *a, int64_t b, int64_t g, int64_t t,
                                  int64_t j) {
  const int64_t from_tail = t - (a->S - a->tail);
  return from_tail >= 0 ? kv_at(a->tk, (int)a->kv_form, a->ts, b, g, from_tail)
                        : kv_at(a->k, (int)a->kv_form, a->ks, b, g, j);
}
static inline const void *value_row(const Attention *a, int64_t b, int64_t g, int64_t t,
                                    int64_t j) {
  const int64_t from_tail = t - (a->S - a->tail);
  return from_tail >= 0 ? kv_at(a->tv, (int)a->kv_form, a->tvs, b, g, from_tail)
                        : kv_at(a->v, (int)a->kv_form, a->vs, b, g, j);
}

static inline vf kv_load(const void *row, int form, int64_t d) {
  return form == FORM_BF16 ? ld_bf16((const uint16_t *)row + d) : LDF((const float *)row + d);
}

/* s[r][j] = q[r] . k[j] for rows [0, rows_pad) and keys [0, n) of the block (keys past n
   repeat the last one and are not stored). */
static void block_scores(const float *q, const void *const *keys, int form, int64_t rows_pad,
                         int64_t n, int64_t D, float *s, const void *const *next_keys,
                         const void *const *next_values, int64_t next_n) {
  const int64_t elem = form == FORM_BF16 ? 2 : 4;
  for (int64_t r = 0; r < rows_pad; r += 4) {
    for (int64_t j = 0; j < n; j += 4) {
      const void *kr[4];
      for (int t = 0; t < 4; ++t) kr[t] = keys[min64(j + t, n - 1)];
      vf acc[4][4];
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 4; ++t) acc[i][t] = ZERO();
      for (int64_t d = 0; d < D; d += VW) {
        /* The next block's rows, a line at a time beside the first rows' products: a decode
           step reads each layer's cache cold (the weights streamed through the caches since),
           and the kernel waited on memory for 3-4x its compute. A prefetch never faults. */
        if (r == 0 && (d * elem) % 64 == 0)
          for (int t = 0; t < 4 && j + t < next_n; ++t) {
            _mm_prefetch((const char *)next_keys[j + t] + d * elem, _MM_HINT_T0);
            _mm_prefetch((const char *)next_values[j + t] + d * elem, _MM_HINT_T0);
          }
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

static inline int64_t floordiv(int64_t x, int64_t y) { return x >= 0 ? x / y : -((-x + y - 1) / y); }

/* The absolute position of row b's oldest key, and the buffer index of key t (t = 0 the oldest),
   for a cache whose buffer wraps around (a sliding window's ring). */
static inline int64_t first_position(const Attention *a, int64_t b) {
  return a->kpos ? a->kpos[b] : 0;
}
static inline int64_t buffer_index(const Attention *a, int64_t b, int64_t t) {
  if (!a->krot) return t;
  const int64_t ring = a->ring > 0 ? a->ring : a->S;
  int64_t j = a->krot[b] + t;
  return j >= ring ? j - ring : j;
}

/* Merges one span's partial softmax (m, l, acc) into the running (M, L, Acc) of a row. One
   compiled body (noinline) serves the merge inside a work item and the merge of split items, so
   both round alike: a row's result does not depend on how the keys were split over threads. */
static __attribute__((noinline)) void merge_span(float *M, float *Lsum, float *Acc, float m,
                                                 float l, const float *acc, int64_t D) {
  if (m == -INFINITY) return;
  if (*M == -INFINITY) {
    *M = m;
    *Lsum = l;
    memcpy(Acc, acc, (size_t)D * 4);
    return;
  }
  float best = m > *M ? m : *M;
  float wa = expf(*M - best), wb = expf(m - best);
  *Lsum = *Lsum * wa + l * wb;
  for (int64_t d = 0; d < D; ++d) Acc[d] = Acc[d] * wa + acc[d] * wb;
  *M = best;
}

static __attribute__((noinline)) void write_row(float *dst, const float *Acc, float Lsum,
                                                int64_t D) {
  float inv = 1.0f / Lsum;
  for (int64_t d = 0; d < D; ++d) dst[d] = Acc[d] * inv;
}

/* One work item: query rows [q0, q0 + nq) x the heads of kv head g of batch row b, over its
   share of the spans. The keys are visited in order of absolute position, in blocks of KB at
   multiples of KB, each SPAN of positions as its own partial softmax merged in span order: a
   row's result is then the same bits whether the keys came in one call or in chunks, from a
   ring buffer or in order, in a decode step or in a prefill, alone or batched. */
static void attention_item(const void *arg, int64_t item) {
  const Plan *plan = (const Plan *)arg;
  const Attention *a = plan->a;
  const int64_t D = a->D, rep = plan->rep, L = a->L, S = a->S;
  const int form = (int)a->kv_form;
  int64_t split = item % plan->splits, group = item / plan->splits;
  int64_t qb = group % plan->qblocks, bg = group / plan->qblocks;
  int64_t g = bg % a->kv_heads, b = bg / a->kv_heads;
  int64_t q0 = qb * plan->per_block, nq = min64(plan->per_block, L - q0);
  int64_t rows = nq * rep, rows_pad = (rows + 3) & ~(int64_t)3;

  /* Keys present: positions [pos0, pos_end); causal rules out those past the last query. */
  const int64_t pos0 = first_position(a, b), last_query0 = pos0 + (S - L);
  int64_t pos_end = pos0 + S;
  if (a->mask_kind == MASK_CAUSAL) pos_end = min64(pos_end, last_query0 + q0 + nq);
  const int64_t span0 = floordiv(pos0, SPAN);
  const int64_t k_lo = split * plan->per_split, k_hi = min64(plan->spans, k_lo + plan->per_split);

  /* aligned_alloc takes a size that is a multiple of the alignment (C11; ASan enforces it). */
  size_t bytes = (size_t)(rows_pad * D * 3 + rows_pad * KB + rows_pad * 4) * 4;
  float *q = aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!q) { /* out of memory: the caller reports it, nothing is written */
    atomic_store_explicit((_Atomic int *)&plan->failed, 1, memory_order_relaxed);
    return;
  }
  float *acc = q + rows_pad * D, *Acc = acc + rows_pad * D, *s = Acc + rows_pad * D;
  float *m = s + rows_pad * KB, *l = m + rows_pad, *M = l + rows_pad, *Lsum = M + rows_pad;
  memset(q, 0, (size_t)(rows_pad * D) * 4);
  for (int64_t r = 0; r < rows_pad; ++r) { M[r] = -INFINITY; Lsum[r] = 0.f; }
  for (int64_t r = 0; r < rows; ++r) {
    int64_t i = q0 + r / rep, head = g * rep + r % rep;
    const float *src = a->q + b * a->qs[0] + head * a->qs[1] + i * a->qs[2];
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = src[d] * a->scale;
  }

  const void *keys[KB], *values[KB];
  for (int64_t k = k_lo; k < k_hi; ++k) {
    const int64_t p0 = (span0 + k) * SPAN, p1 = min64(p0 + SPAN, pos_end);
    memset(acc, 0, (size_t)(rows_pad * D) * 4);
    for (int64_t r = 0; r < rows_pad; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
    for (int64_t P = p0 > pos0 ? p0 : floordiv(pos0, KB) * KB; P < p1; P += KB) {
      /* Columns [c_lo, c_hi) of this block hold keys; the others are -inf, as if masked. */
      const int64_t c_lo = pos0 > P ? pos0 - P : 0, c_hi = min64(KB, p1 - P);
      if (c_lo >= c_hi) continue;
      const int64_t n = c_hi - c_lo;
      int64_t at[KB];  /* buffer index of each present key */
      int64_t col[KB]; /* its mask column: its slot, or with a ring its place in position order */
      for (int64_t c = 0; c < n; ++c) {
        at[c] = buffer_index(a, b, P + c_lo + c - pos0);
        col[c] = a->ring > 0 ? P + c_lo + c - pos0 : at[c];
      }
      if (a->mask_kind == MASK_BOOL) { /* skip a block no row may see */
        int any = 0;
        for (int64_t r = 0; r < rows && !any; ++r)
          for (int64_t c = 0; c < n && !any; ++c)
            any = mask_allows(a, b, g * rep + r % rep, q0 + r / rep, col[c]);
        if (!any) continue;
      }
      for (int64_t c = 0; c < n; ++c) {
        keys[c] = key_row(a, b, g, P + c_lo + c - pos0, at[c]);
        values[c] = value_row(a, b, g, P + c_lo + c - pos0, at[c]);
      }
      const int64_t next_n = min64(KB, p1 - P - KB); /* the next block's keys, to prefetch */
      const void *next_keys[KB], *next_values[KB];
      for (int64_t c = 0; c < next_n; ++c) {
        const int64_t t = P + KB + c - pos0;
        next_keys[c] = key_row(a, b, g, t, buffer_index(a, b, t));
        next_values[c] = value_row(a, b, g, t, buffer_index(a, b, t));
      }
      block_scores(q, keys, form, rows_pad, n, D, s + c_lo, next_keys, next_values, next_n);
      for (int64_t r = 0; r < rows_pad; ++r) {
        float *sr = s + r * KB;
        if (r >= rows) { memset(sr, 0, KB * sizeof(float)); continue; }
        for (int64_t c = 0; c < c_lo; ++c) sr[c] = -INFINITY;
        for (int64_t c = c_hi; c < KB; ++c) sr[c] = -INFINITY;
        int64_t i = q0 + r / rep, head = g * rep + r % rep;
        if (a->mask_kind == MASK_CAUSAL) {
          int64_t limit = last_query0 + i;
          for (int64_t c = c_lo; c < c_hi; ++c)
            if (P + c > limit) sr[c] = -INFINITY;
        } else if (a->mask_kind == MASK_BOOL) {
          for (int64_t c = c_lo; c < c_hi; ++c)
            if (!mask_allows(a, b, head, i, col[c - c_lo])) sr[c] = -INFINITY;
        } else if (a->mask_kind == MASK_ADD) {
          const int64_t *ms = a->ms;
          const float *mr = (const float *)a->mask + b * ms[0] + head * ms[1] + i * ms[2];
          for (int64_t c = c_lo; c < c_hi; ++c) sr[c] += mr[col[c - c_lo] * ms[3]];
        }
        float best = -INFINITY;
        for (int64_t c = 0; c < KB; ++c) best = sr[c] > best ? sr[c] : best;
        if (best == -INFINITY) { memset(sr, 0, KB * sizeof(float)); continue; }
        float m_new = best > m[r] ? best : m[r];
        float corr = expf(m[r] - m_new); /* 0 while nothing was seen */
        /* The whole block in vectors (vexp gives exactly 0 for -inf): each key's exponential
           and its lane of the sum do not depend on how many keys the block held. */
        vf vm = SET1(m_new), vs = ZERO();
        for (int64_t c = 0; c < KB; c += VW) {
          vf e = vexp(SUB(LDF(sr + c), vm));
          STF(sr + c, e);
          vs = ADD(vs, e);
        }
        float sum = hsum(vs);
        if (corr != 1.0f) {
          float *ar = acc + r * D;
          for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
        }
        l[r] = l[r] * corr + sum;
        m[r] = m_new;
      }
      block_values(s + c_lo, values, form, rows_pad, n, D, acc);
    }
    if (plan->splits > 1) {
      float *part = plan->part + (group * plan->spans + k) * plan->rows_max * (D + 2);
      for (int64_t r = 0; r < rows; ++r, part += D + 2) {
        part[0] = m[r];
        part[1] = l[r];
        memcpy(part + 2, acc + r * D, (size_t)D * 4);
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) merge_span(M + r, Lsum + r, Acc + r * D, m[r], l[r],
                                                    acc + r * D, D);
    }
  }

  if (plan->splits == 1) {
    for (int64_t r = 0; r < rows; ++r) {
      if (M[r] == -INFINITY) continue; /* every key masked: the caller fills it */
      int64_t i = q0 + r / rep, head = g * rep + r % rep;
      plan->written[(b * a->heads + head) * L + i] = 1;
      write_row(a->out + b * a->os[0] + head * a->os[1] + i * a->os[2], Acc + r * D, Lsum[r], D);
    }
  }
  free(q);
}

/* The mean of the values: MLX's answer for a row whose every key is masked. */
static void mean_values(const Attention *a, int64_t b, int64_t g, float *dst) {
  for (int64_t d = 0; d < a->D; ++d) dst[d] = 0.f;
  for (int64_t t = 0; t < a->S; ++t) {
    const void *row = value_row(a, b, g, t, buffer_index(a, b, t));
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
  if (a->tail < 0 || a->tail > a->S || a->S_buf < 0 ||
      (a->tail > 0 && (!a->tk || !a->tv || a->ts[3] != 1 || a->tvs[3] != 1)))
    return -1;
  const int64_t ring = a->ring > 0 ? a->ring : a->S;
  if (a->S - a->tail > ring) return -1;
  for (int64_t b = 0; b < a->B; ++b) { /* every key read from the buffer lies in it */
    const int64_t rot = a->krot ? a->krot[b] : 0, n = a->S - a->tail;
    if (rot < 0 || rot >= ring) return -1;
    if (n > 0 && (rot + n - 1 < ring ? rot + n - 1 : ring - 1) >= a->S_buf) return -1;
  }
  Plan plan = {.a = a, .rep = a->heads / a->kv_heads};
  plan.per_block = plan.rep >= ROWS_MAX ? 1 : ROWS_MAX / plan.rep;
  if (plan.per_block > a->L) plan.per_block = a->L;
  plan.qblocks = (a->L + plan.per_block - 1) / plan.per_block;
  plan.rows_max = plan.per_block * plan.rep;
  plan.spans = 1;
  for (int64_t b = 0; b < a->B; ++b) {
    int64_t first = first_position(a, b);
    int64_t spans = floordiv(first + a->S - 1, SPAN) - floordiv(first, SPAN) + 1;
    if (spans > plan.spans) plan.spans = spans;
  }
  int64_t groups = a->B * a->kv_heads * plan.qblocks, threads = a->threads < 1 ? 1 : a->threads;
  plan.splits = 1;
  if (groups < 2 * threads && plan.spans >= 2) {
    plan.splits = (2 * threads + groups - 1) / groups;
    if (plan.splits > plan.spans) plan.splits = plan.spans;
  }
  plan.per_split = (plan.spans + plan.splits - 1) / plan.splits;
  plan.splits = (plan.spans + plan.per_split - 1) / plan.per_split;
  if (plan.splits > 1) {
    plan.part = malloc((size_t)(groups * plan.spans * plan.rows_max * (a->D + 2)) * 4);
    if (!plan.part) return -2;
    /* Spans no item reaches (past a causal block's last query) read as empty. */
    for (int64_t at = 0; at < groups * plan.spans * plan.rows_max; ++at)
      plan.part[at * (a->D + 2)] = -INFINITY;
  }
  plan.written = calloc((size_t)(a->B * a->heads * a->L), 1);
  if (!plan.written) { free(plan.part); return -2; }
  run_blocks(attention_item, &plan, groups * plan.splits, (int)threads);
  if (atomic_load_explicit(&plan.failed, memory_order_relaxed)) {
    free(plan.part);
    free(plan.written);
    return -2;
  }

  if (plan.splits > 1) {
    float *Acc = malloc((size_t)a->D * 4);
    if (!Acc) { free(plan.part); free(plan.written); return -2; }
    for (int64_t group = 0; group < groups; ++group) {
      int64_t qb = group % plan.qblocks, bg = group / plan.qblocks;
      int64_t g = bg % a->kv_heads, b = bg / a->kv_heads;
      int64_t q0 = qb * plan.per_block, nq = min64(plan.per_block, a->L - q0);
      for (int64_t r = 0; r < nq * plan.rep; ++r) {
        int64_t i = q0 + r / plan.rep, head = g * plan.rep + r % plan.rep;
        float M = -INFINITY, Lsum = 0.f;
        for (int64_t k = 0; k < plan.spans; ++k) {
          const float *part =
              plan.part + ((group * plan.spans + k) * plan.rows_max + r) * (a->D + 2);
          merge_span(&M, &Lsum, Acc, part[0], part[1], part + 2, a->D);
        }
        if (M == -INFINITY) continue;
        plan.written[(b * a->heads + head) * a->L + i] = 1;
        write_row(a->out + b * a->os[0] + head * a->os[1] + i * a->os[2], Acc, Lsum, a->D);
      }
    }
    free(Acc);
    free(plan.part);
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
