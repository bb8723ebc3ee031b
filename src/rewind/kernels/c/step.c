/* A step through a range of layers in one call, for blocks of token rows that each attend over
   their own KV cache: per layer, layer_pre over all rows, each block's attention over its cache
   as it was before the step plus the block's own new keys and values (attention.c's tail), then
   layer_post over all rows.

   Why: the same calls made one layer at a time from Python cost ~3.5 ms of a ~21 ms decode token
   of Gemma 3 270M on 2 cores (three boundary crossings a layer, NumPy views, MLX arrays for the
   new keys): as much as the gap to llama.cpp's decode. The calls here are exactly those, in the
   same order on the same buffers, so a row's bits are the per-layer path's; the caches' MLX
   updates are queued after the call from the keys and values this step leaves in `qkv`.

   Memory: the boundary (rewind.kernels.boundary.Kernels.step_layers) checked every buffer, every
   mask, and that every slot a cache's layout reaches lies inside its buffers, and holds them
   until this returns. */
#include <stdint.h>

#include "attention.h"
#include "layer.h"
#include "simd.h"

/* One block's KV cache in one layer before this step: k, v [1, kv_heads, S_buf, D] float32 with
   element strides ks / vs; the step's attention reads S keys, the last `rows` of them the
   block's new ones, the others from the buffers in order of position from kpos, the oldest in
   slot krot of a ring of `ring` slots (0: S). mask_kind as attention.c's, with a mask
   [1, heads, rows, S] at address `mask` (strides ms) for the array kinds. Addresses as integers:
   the boundary fills a table of these with NumPy, a row at a time. */
typedef struct {
  int64_t k, v;
  int64_t ks[4], vs[4];
  int64_t S_buf, S, kpos, krot, ring;
  int64_t mask_kind, mask;
  int64_t ms[4];
} StepCache;

typedef struct {
  const Layer *layer;
  const Shape *shape;
  const float *inv_freq; /* [rope_dims / 2] */
  float scale;           /* attention's */
} StepLayer;

/* x [m, H] through layers [first, stop): `blocks` blocks of rows, block b the next
   block_rows[b] rows of x, each row at positions[r]. qkv [stop - first, m, width] keeps each
   layer's projections (the new keys and values for the caches' updates); scratch [m, H + 3 I];
   attended [m, heads D]; caches [(stop - first) * blocks], layer-major. Every layer has the same
   widths. 0, -1 for a shape the kernels do not take (nothing more is run), -2 when scratch
   memory ran out. */
int step_layers(const StepLayer *layers, int64_t first, int64_t stop, int64_t blocks,
                const int64_t *block_rows, const StepCache *caches, float *x, int64_t m,
                const int64_t *positions, float *qkv, float *scratch, float *attended) {
  if (first < 0 || stop <= first || blocks < 1 || m < 1) return -1;
  int64_t rows_total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (block_rows[b] < 1) return -1;
    rows_total += block_rows[b];
  }
  if (rows_total != m) return -1;
  const Shape *shape0 = layers[first].shape;
  const int64_t nH = shape0->heads, nKV = shape0->kv_heads, D = shape0->head_dim;
  const int64_t width = (nH + 2 * nKV) * D, A = nH * D;
  for (int64_t l = first; l < stop; ++l) {
    const Shape *S = layers[l].shape;
    if (S->heads != nH || S->kv_heads != nKV || S->head_dim != D ||
        S->hidden != shape0->hidden || S->intermediate != shape0->intermediate)
      return -1;
  }
  for (int64_t l = first; l < stop; ++l) {
    const StepLayer *layer = &layers[l];
    float *projected = qkv + (l - first) * m * width;
    int status = layer_pre(layer->layer, layer->shape, x, m, positions, layer->inv_freq,
                           projected, scratch);
    if (status) return status;
    int64_t row = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const StepCache *c = &caches[(l - first) * blocks + b];
      const int64_t L = block_rows[b];
      const float *q = projected + row * width;
      Attention a = {
          .q = q, .k = (const void *)(intptr_t)c->k, .v = (const void *)(intptr_t)c->v,
          .qs = {L * width, D, width, 1},
          .ks = {c->ks[0], c->ks[1], c->ks[2], c->ks[3]},
          .vs = {c->vs[0], c->vs[1], c->vs[2], c->vs[3]},
          .mask = (const void *)(intptr_t)c->mask, .ms = {c->ms[0], c->ms[1], c->ms[2], c->ms[3]},
          .mask_kind = c->mask_kind,
          .out = attended + row * A, .os = {L * A, D, A, 1},
          .B = 1, .heads = nH, .kv_heads = nKV, .L = L, .S = c->S, .D = D,
          .scale = layer->scale, .kv_form = FORM_F32, .threads = layer->shape->threads,
          .kpos = &c->kpos, .krot = &c->krot,
          .tail = L, .S_buf = c->S_buf,
          .tk = q + A, .tv = q + A + nKV * D,
          .ts = {L * width, D, width, 1}, .tvs = {L * width, D, width, 1},
          .ring = c->ring};
      status = attention(&a);
      if (status) return status;
      row += L;
    }
    status = layer_post(layer->layer, layer->shape, x, m, attended, scratch);
    if (status) return status;
  }
  return 0;
}
