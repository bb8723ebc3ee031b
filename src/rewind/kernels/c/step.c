/* A decode step through every layer in one call: for each layer, layer_pre over all rows, each
   row's attention over its own KV cache as it was before the step plus the row's new key and
   value (attention.c's tail), then layer_post over all rows.

   Why: the same calls made one layer at a time from Python cost ~3.5 ms of a ~21 ms token of
   Gemma 3 270M on 2 cores (three boundary crossings a layer, NumPy views, MLX arrays for the new
   keys): as much as the gap to llama.cpp's decode. The calls here are exactly those, in the
   same order on the same buffers, so a row's bits are the per-layer path's; the caches' MLX
   updates are queued after the call from the keys and values this step leaves in `qkv`.

   Memory: the boundary (rewind.kernels.boundary.Kernels.decode_step) checked every buffer and
   that every slot a cache's layout reaches lies inside its buffers, and holds them until this
   returns. */
#include <stdint.h>

#include "attention.h"
#include "layer.h"
#include "simd.h"

/* One row's KV cache in one layer before this step: k, v [1, kv_heads, S_buf, D] float32 with
   element strides ks / vs; after this step it holds S keys (the new one included), the oldest
   at absolute position kpos in slot krot. Addresses as integers: the boundary fills a table of
   these with NumPy, a row at a time. */
typedef struct {
  int64_t k, v;
  int64_t ks[4], vs[4];
  int64_t S_buf, S, kpos, krot;
} StepCache;

typedef struct {
  const Layer *layer;
  const Shape *shape;
  const float *inv_freq; /* [rope_dims / 2] */
  float scale;           /* attention's */
} StepLayer;

/* x [m, H] through every layer, one decode token a row at positions[r]. qkv [n_layers, m, width]
   keeps each layer's projections (its new keys and values for the caches' updates); scratch
   [m, H + 3 I]; attended [m, heads D]; caches [n_layers * m], layer-major. Every layer has the
   same widths. 0, -1 for a shape the kernels do not take (nothing more is run), -2 when scratch
   memory ran out. */
int decode_step(const StepLayer *layers, int64_t n_layers, const StepCache *caches, float *x,
                int64_t m, const int64_t *positions, float *qkv, float *scratch, float *attended) {
  if (n_layers < 1 || m < 1) return -1;
  const Shape *first = layers[0].shape;
  const int64_t nH = first->heads, nKV = first->kv_heads, D = first->head_dim;
  const int64_t width = (nH + 2 * nKV) * D, A = nH * D;
  for (int64_t l = 0; l < n_layers; ++l) {
    const Shape *S = layers[l].shape;
    if (S->heads != nH || S->kv_heads != nKV || S->head_dim != D ||
        S->hidden != first->hidden || S->intermediate != first->intermediate)
      return -1;
  }
  for (int64_t l = 0; l < n_layers; ++l) {
    const StepLayer *layer = &layers[l];
    float *projected = qkv + l * m * width;
    int status = layer_pre(layer->layer, layer->shape, x, m, positions, layer->inv_freq,
                           projected, scratch);
    if (status) return status;
    for (int64_t r = 0; r < m; ++r) {
      const StepCache *c = &caches[l * m + r];
      const float *row = projected + r * width;
      Attention a = {
          .q = row, .k = (const void *)(intptr_t)c->k, .v = (const void *)(intptr_t)c->v,
          .qs = {width, D, width, 1},
          .ks = {c->ks[0], c->ks[1], c->ks[2], c->ks[3]},
          .vs = {c->vs[0], c->vs[1], c->vs[2], c->vs[3]},
          .mask = 0, .mask_kind = MASK_NONE,
          .out = attended + r * A, .os = {A, D, A, 1},
          .B = 1, .heads = nH, .kv_heads = nKV, .L = 1, .S = c->S, .D = D,
          .scale = layer->scale, .kv_form = FORM_F32, .threads = layer->shape->threads,
          .kpos = &c->kpos, .krot = &c->krot,
          .tail = 1, .S_buf = c->S_buf,
          .tk = row + A, .tv = row + A + nKV * D,
          .ts = {width, D, width, 1}, .tvs = {width, D, width, 1}};
      status = attention(&a);
      if (status) return status;
    }
    status = layer_post(layer->layer, layer->shape, x, m, attended, scratch);
    if (status) return status;
  }
  return 0;
}
