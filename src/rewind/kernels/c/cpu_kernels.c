/* CPU kernels for a transformer layer: weight-streaming matrix products and the per-row work
   around attention, for one row (a decode step) up to hundreds (a prefill chunk).

   Why: MLX's CPU backend has no fast bf16 or int8 matmul (both run slower than float32 through
   BLAS), so a model must be widened to float32 (twice the bytes), and each of the ~40 graph
   nodes of a layer costs tens of microseconds. These kernels read weights as bf16 (exact for
   bf16 checkpoints), int8 with one scale per output row, or float32, widen them in registers
   and accumulate in float32 with FMA, RB output rows against XG activation rows at a time: read
   once per decode step, and at ~220 GFLOP/s on a 512-row chunk (2 cores, AVX-512), as fast as
   OpenBLAS on float32. `layer_pre` and `layer_post` do everything of a layer except the KV-cache
   update (MLX, rewind.kernels.native_forward) and attention (attention.c), so every cache class,
   mask and the prompt cache keep working unchanged.

   Threads: the pool in pool.c, not OpenMP (why: there).

   Built at first use by rewind.kernels.native with the system C compiler (AVX-512 where the CPU
   has it, else AVX2); without a compiler Rewind keeps MLX's path. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "layer.h"
#include "quant.h"
#include "simd.h"

enum { ACT_GELU_TANH = 0, ACT_SILU = 1 };

#define RB 4 /* output rows per block: independent FMA chains, weights read once */

/* Each block fetches the rows it will read two blocks on while it computes (as quant.c's
   tiles: the hardware prefetcher alone left the one-row product well below the memory
   bandwidth). A prefetch never faults: past the matrix's end it does nothing. */
#define PREFETCH_ROWS (2 * RB)
static inline void prefetch_weights(const void *w, int form, int64_t i) {
  const int64_t bytes = form == FORM_F32 ? 4 : form == FORM_BF16 ? 2 : 1;
  _mm_prefetch((const char *)w + i * bytes, _MM_HINT_T0);
}

/* One block of RB output rows against NX activation rows; NX is a constant per copy so the
   compiler keeps every accumulator in a register. */
#define DEFINE_BLOCK(NX)                                                                        \
  static inline void block_##NX(const void *W, const float *scale, int form, const float *x,    \
                                float *y, int64_t o0, int64_t nr, int64_t in, int64_t ldy,      \
                                int64_t r0) {                                                   \
    vf acc[RB][NX];                                                                             \
    for (int i = 0; i < RB; ++i)                                                                \
      for (int j = 0; j < NX; ++j) acc[i][j] = ZERO();                                          \
    int64_t k = 0;                                                                              \
    if (nr == RB) {                                                                             \
      for (; k + VW <= in; k += VW) {                                                           \
        vf w[RB];                                                                               \
        for (int i = 0; i < RB; ++i) {                                                          \
          prefetch_weights(W, form, (o0 + i + PREFETCH_ROWS) * in + k);                         \
          w[i] = load_weights(W, form, (o0 + i) * in + k);                                      \
        }                                                                                       \
        for (int j = 0; j < NX; ++j) {                                                          \
          vf xv = LDF(x + (r0 + j) * in + k);                                                   \
          for (int i = 0; i < RB; ++i) acc[i][j] = FMA(w[i], xv, acc[i][j]);                    \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
    for (int i = 0; i < nr; ++i)                                                                \
      for (int j = 0; j < NX; ++j) {                                                            \
        float s = k ? hsum(acc[i][j]) : 0.f;                                                    \
        for (int64_t kk = k; kk < in; ++kk)                                                     \
          s += weight_at(W, form, (o0 + i) * in + kk) * x[(r0 + j) * in + kk];                 \
        if (scale) s *= scale[o0 + i];                                                          \
        y[(r0 + j) * ldy + o0 + i] = s;                                                         \
      }                                                                                         \
  }
DEFINE_BLOCK(1)
DEFINE_BLOCK(2)
#if XG >= 4
DEFINE_BLOCK(3)
DEFINE_BLOCK(4)
#endif


typedef struct {
  const void *W; const float *scale; int form; const float *x; float *y;
  int64_t out, in, m, ldy, claim_rows;
} MatvecJob;

#define ROWS_PER_CLAIM 64 /* output rows per claimed block: a multiple of RB */

/* Output rows a claim takes: ROWS_PER_CLAIM with more than XG activation rows, else
   few_rows_claim's (simd.h), in whole RB blocks, so the blocks, and with them each row's sums,
   stay where they were. */
static int64_t matvec_claim_rows(int64_t out, int64_t in, int form, int64_t m, int threads) {
  const int64_t bytes = form == FORM_F32 ? 4 : form == FORM_BF16 ? 2 : 1;
  return m > XG ? ROWS_PER_CLAIM : few_rows_claim(out, in * bytes, threads, ROWS_PER_CLAIM, RB);
}

static void matvec_block(const void *arg, int64_t claim) {
  const MatvecJob *j = (const MatvecJob *)arg;
  const int64_t first = claim * j->claim_rows;
  int64_t end = first + j->claim_rows < j->out ? first + j->claim_rows : j->out;
  for (int64_t o0 = first; o0 < end; o0 += RB) {
    int64_t nr = end - o0 < RB ? end - o0 : RB;
    for (int64_t r0 = 0; r0 < j->m; r0 += XG) {
      switch (j->m - r0 < XG ? j->m - r0 : XG) {
        case 1: block_1(j->W, j->scale, j->form, j->x, j->y, o0, nr, j->in, j->ldy, r0); break;
        case 2: block_2(j->W, j->scale, j->form, j->x, j->y, o0, nr, j->in, j->ldy, r0); break;
#if XG >= 4
        case 3: block_3(j->W, j->scale, j->form, j->x, j->y, o0, nr, j->in, j->ldy, r0); break;
        case 4: block_4(j->W, j->scale, j->form, j->x, j->y, o0, nr, j->in, j->ldy, r0); break;
#endif
      }
    }
  }
}

/* y[r][o] = scale[o] * sum_k W[o][k] x[r][k]; W [out, in] row-major in `form`; x [m, in],
   y [m, ldy] float32. Output rows are split across `threads`. */
static int matvec_ld(const void *W, const float *scale, int form, const float *x, float *y,
                     int64_t out, int64_t in, int64_t ldy, int64_t m, int threads) {
  if (m < 1 || out < 1 || in < 1 || ldy < out) return -1;
  const int64_t claim_rows = matvec_claim_rows(out, in, form, m, threads);
  MatvecJob job = {W, scale, form, x, y, out, in, m, ldy, claim_rows};
  run_blocks(matvec_block, &job, (out + claim_rows - 1) / claim_rows, threads);
  return 0;
}

/* out = x * rsqrt(mean(x^2) + eps) * w, as mx.fast.rms_norm (w already holds 1 + w for Gemma). */
static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  float inv = 1.0f / sqrtf(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

/* mx.fast.rope on the head vectors of one row: the first `dims` entries of each rotate, the rest
   pass through. cs: 2 * dims / 2 floats of scratch (the angles are the same for every head). */
static void rope_heads(float *row, int64_t heads, int64_t D, int64_t dims, float position,
                       const float *inv_freq, int traditional, float *cs) {
  int64_t half = dims / 2;
  for (int64_t i = 0; i < half; ++i) {
    float theta = position * inv_freq[i];
    cs[i] = cosf(theta);
    cs[half + i] = sinf(theta);
  }
  for (int64_t h = 0; h < heads; ++h) {
    float *v = row + h * D;
    for (int64_t i = 0; i < half; ++i) {
      float c = cs[i], s = cs[half + i];
      int64_t a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
      float x1 = v[a], x2 = v[b];
      v[a] = x1 * c - x2 * s;
      v[b] = x1 * s + x2 * c;
    }
  }
}

/* y = W x (+ bias) for m rows, each part's rows through its own kernel. */
static int apply(const Matrix *M, const float *x, float *y, int64_t out, int64_t in, int64_t m,
                 int threads) {
  if (M->count < 1 || M->count > MAX_PARTS) return -1;
  int64_t first = 0;
  QPart blocks[MAX_PARTS]; /* the parts stored as ggml blocks: one job for all of them */
  int nblocks = 0;
  for (int64_t p = 0; p < M->count; ++p) {
    const Part *part = &M->parts[p];
    if (part->rows < 1 || first + part->rows > out) return -1;
    if (part->form >= FORM_GGML) {
      blocks[nblocks++] = (QPart){part->weight, (int)(part->form - FORM_GGML), first, part->rows};
    } else {
      int status = matvec_ld(part->weight, part->scale, (int)part->form, x, y + first,
                             part->rows, in, out, m, threads);
      if (status) return status;
    }
    first += part->rows;
  }
  if (first != out) return -1;
  if (nblocks) {
    int status = qmatvec_parts(blocks, nblocks, x, y, out, in, m, threads);
    if (status) return status;
  }
  if (!M->bias) return 0;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += M->bias[o];
  return 0;
}

/* y [m, out] = M x [m, in]: a stacked matrix's product alone (a linear layer, the head). */
int matrix_product(const Matrix *M, const float *x, float *y, int64_t out, int64_t in, int64_t m,
                   int threads) {
  if (m < 1 || out < 1 || in < 1) return -1;
  return apply(M, x, y, out, in, m, threads);
}

/* Per-row work of a layer, spread over the pool in blocks of rows. */
typedef struct {
  const Layer *L;
  const Shape *S;
  float *x;                 /* [m, H] residual stream */
  float *qkv;               /* [m, width] */
  float *proj, *gate_up, *act;
  const int64_t *positions;
  const float *inv_freq;
  int64_t m;
} Rows;
typedef void (*RowFn)(const Rows *job, int64_t r);
typedef struct {
  const Rows *job;
  RowFn fn;
} RowTask;

#define ROWS_PER_TASK 16

static void row_block(const void *arg, int64_t block) {
  const RowTask *task = (const RowTask *)arg;
  int64_t end = (block + 1) * ROWS_PER_TASK;
  if (end > task->job->m) end = task->job->m;
  for (int64_t r = block * ROWS_PER_TASK; r < end; ++r) task->fn(task->job, r);
}

static void for_rows(const Rows *job, RowFn fn) {
  RowTask task = {job, fn};
  run_blocks(row_block, &task, (job->m + ROWS_PER_TASK - 1) / ROWS_PER_TASK, (int)job->S->threads);
}

static void input_norm_row(const Rows *j, int64_t r) {
  const int64_t H = j->S->hidden;
  rms_norm(j->x + r * H, j->L->input_norm, j->S->eps, H, j->proj + r * H);
}

static void qk_row(const Rows *j, int64_t r) {
  const Shape *S = j->S;
  const int64_t D = S->head_dim, nH = S->heads, nKV = S->kv_heads;
  float *row = j->qkv + r * (nH + 2 * nKV) * D;
  for (int64_t h = 0; h < nH + nKV; ++h) {
    const float *norm = h < nH ? j->L->q_norm : j->L->k_norm;
    if (norm) rms_norm(row + h * D, norm, S->eps, D, row + h * D);
  }
  float cs[1024];
  float position = (float)j->positions[r] * S->rope_scale;
  rope_heads(row, nH + nKV, D, S->rope_dims, position, j->inv_freq, (int)S->traditional, cs);
}

/* Before attention: h = norm(x); q, k, v = projections of h; per-head q/k norms; RoPE at each
   row's position. qkv_out [m, (nH + 2 nKV) D]. scratch: [m, H]. */
int layer_pre(const Layer *L, const Shape *S, const float *x, int64_t m, const int64_t *positions,
              const float *inv_freq, float *qkv_out, float *scratch) {
  const int64_t H = S->hidden, D = S->head_dim, nH = S->heads, nKV = S->kv_heads;
  if (S->rope_dims > 1024) return -2; /* rope_heads' scratch */
  Rows job = {L, S, (float *)x, qkv_out, scratch, NULL, NULL, positions, inv_freq, m};
  for_rows(&job, input_norm_row);
  int status = apply(&L->qkv, scratch, qkv_out, (nH + 2 * nKV) * D, H, m, (int)S->threads);
  if (status) return status;
  for_rows(&job, qk_row);
  return 0;
}

/* x += post_attn_norm(o_proj(attn)); proj = pre_ff_norm(x). */
static void attn_residual_row(const Rows *j, int64_t r) {
  const int64_t H = j->S->hidden;
  float *p = j->proj + r * H, *xr = j->x + r * H;
  if (j->L->post_attn_norm) rms_norm(p, j->L->post_attn_norm, j->S->eps, H, p);
  for (int64_t i = 0; i < H; ++i) xr[i] += p[i];
  rms_norm(xr, j->L->pre_ff_norm, j->S->eps, H, p);
}

/* act = gelu_tanh(gate) * up, or silu(gate) * up; gelu_tanh(g) = 0.5 g (1 + tanh(u)) is
   g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3), with a vectorized exp. */
static void activation_row(const Rows *j, int64_t r) {
  const int64_t I = j->S->intermediate;
  const float *g = j->gate_up + r * 2 * I, *u = g + I;
  float *a = j->act + r * I;
  const int silu = j->S->activation == ACT_SILU;
  const float k = 0.7978845608028654f;
  int64_t i = 0;
  for (; i + VW <= I; i += VW) {
    vf gv = LDF(g + i), e;
    if (silu) {
      e = vexp(SUB(ZERO(), gv));
    } else {
      vf inner = MUL(SET1(k), FMA(MUL(SET1(0.044715f), gv), MUL(gv, gv), gv));
      e = vexp(MUL(SET1(-2.0f), inner));
    }
    STF(a + i, MUL(DIV(gv, ADD(SET1(1.0f), e)), LDF(u + i)));
  }
  for (; i < I; ++i) {
    float gi = g[i], e;
    if (silu) e = expf(-gi);
    else e = expf(-2.0f * k * (gi + 0.044715f * gi * gi * gi));
    a[i] = gi / (1.0f + e) * u[i];
  }
}

/* x += post_ff_norm(down(...)). */
static void mlp_residual_row(const Rows *j, int64_t r) {
  const int64_t H = j->S->hidden;
  float *p = j->proj + r * H, *xr = j->x + r * H;
  if (j->L->post_ff_norm) rms_norm(p, j->L->post_ff_norm, j->S->eps, H, p);
  for (int64_t i = 0; i < H; ++i) xr[i] += p[i];
}

/* After attention: x += post_attn_norm(o_proj(attn)); x += post_ff_norm(down(act(gate) * up))
   with the MLP input pre_ff_norm(x). x [m, H] in place; attn [m, nH D];
   scratch: [m, H + 3 I] floats. */
int layer_post(const Layer *L, const Shape *S, float *x, int64_t m, const float *attn,
               float *scratch) {
  const int64_t H = S->hidden, I = S->intermediate, A = S->heads * S->head_dim;
  float *proj = scratch, *gate_up = scratch + m * H, *act = gate_up + m * 2 * I;
  Rows job = {L, S, x, NULL, proj, gate_up, act, NULL, NULL, m};
  int status = apply(&L->o, attn, proj, H, A, m, (int)S->threads);
  if (status) return status;
  for_rows(&job, attn_residual_row);
  status = apply(&L->gate_up, proj, gate_up, 2 * I, H, m, (int)S->threads);
  if (status) return status;
  for_rows(&job, activation_row);
  status = apply(&L->down, act, proj, H, I, m, (int)S->threads);
  if (status) return status;
  for_rows(&job, mlp_residual_row);
  return 0;
}

/* out[r] = norm(x[r]) for the final norm. */
int rows_rms_norm(const float *x, const float *w, float eps, int64_t m, int64_t n, float *out) {
  for (int64_t r = 0; r < m; ++r) rms_norm(x + r * n, w, eps, n, out + r * n);
  return 0;
}
