/* One attention call (attention.c): shared with step.c, whose decode step fills one per row and
   layer. */
#ifndef REWIND_ATTENTION_H
#define REWIND_ATTENTION_H
#include <stdint.h>

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
  /* [B] each: the absolute position of a row's oldest key and its buffer index (the buffer
     wraps around S), or NULL for 0 (keys in order from position 0). Keys are visited in order
     of position, so chunked and whole calls round alike. */
  const int64_t *kpos, *krot;
  /* The last `tail` keys and values (per row and kv head) read from tk / tv [B, kv_heads, tail,
     D] (strides ts / tvs), the others from k / v, whose buffers hold `S_buf` slots: a decode
     step reads the cache as it was before its update plus its own new rows, so the cache's
     update need not be evaluated first. tail 0: every key from k / v (S_buf = S). */
  int64_t tail, S_buf;
  const void *tk, *tv;
  int64_t ts[4], tvs[4];
  /* The buffer's ring: slots the buffer's keys wrap around (0: S). A call that reads a ring of
     W slots plus a tail of several keys holds S > W keys (step.c's steps of several rows).
     Mask columns are buffer slots when ring is 0 (mlx-lm rolls a decode step's window mask so),
     and keys in order of position when it is set (the order after mlx-lm's update). */
  int64_t ring;
} Attention;

/* 0, -1 for shapes it does not take, -2 when memory for its scratch ran out. */
int attention(const Attention *a);

#endif
