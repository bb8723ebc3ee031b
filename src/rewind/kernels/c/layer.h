/* The weights and shape of one transformer layer as cpu_kernels.c reads them, and its two calls
   around attention: shared with step.c, whose decode step calls them layer after layer. */
#ifndef REWIND_LAYER_H
#define REWIND_LAYER_H
#include <stdint.h>

/* Rows of a weight matrix in one form: a matrix may stack parts of different forms (a GGUF's
   q and k in Q5_0 over its v in Q8_0). */
typedef struct {
  const void *weight; /* [rows, in] in `form`: float32, bf16, int8, or ggml blocks */
  const float *scale; /* per row (int8), else NULL */
  int64_t form;       /* FORM_*, or FORM_GGML + a ggml type */
  int64_t rows;
} Part;

#define MAX_PARTS 3
typedef struct {
  Part parts[MAX_PARTS];
  int64_t count;
  const float *bias; /* [out] or NULL */
} Matrix;

typedef struct {
  const float *input_norm;  /* [H] */
  Matrix qkv;               /* [(nH + 2 nKV) D, H]: q, k and v projections stacked */
  const float *q_norm;      /* [D] or NULL */
  const float *k_norm;      /* [D] or NULL */
  Matrix o;                 /* [H, nH D] */
  const float *post_attn_norm; /* [H] or NULL (Gemma: norm of the attention output) */
  const float *pre_ff_norm;    /* [H] */
  Matrix gate_up;           /* [2 I, H]: gate then up */
  Matrix down;              /* [H, I] */
  const float *post_ff_norm;   /* [H] or NULL */
} Layer;

typedef struct {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, rope_dims, activation, threads;
  float eps, rope_scale;
  int64_t traditional;
} Shape;

/* Before attention: qkv_out [m, (nH + 2 nKV) D] = RoPE(norms(qkv(norm(x)))). */
int layer_pre(const Layer *L, const Shape *S, const float *x, int64_t m, const int64_t *positions,
              const float *inv_freq, float *qkv_out, float *scratch);
/* After attention: x [m, H] += o(attn) and the MLP, in place. */
int layer_post(const Layer *L, const Shape *S, float *x, int64_t m, const float *attn,
               float *scratch);

#endif
