/* Matrix products over GGUF quantized blocks as stored (ggml's layouts), with int8 dot products.

   Why: on the CPU a decoded token costs the bytes its weights take to read. A Q4_K_M file holds
   Gemma 3 270M in ~240 MB where bf16 takes 536 MB, and its blocks are the weights llama.cpp
   computes with: reading them in place is both cheaper and closer to the file than a bf16 copy
   of their dequantized values.

   How (as ggml-cpu does): each row of activations is quantized per block, to Q8_0 (32 values,
   one scale) for the 32-value weight types and to Q8_K (256 values, one scale, sums of each 16)
   for the k-quants. A block's product is then a sum of int8 x uint8 products, exact in int32:
   AVX2's vpmaddubsw + vpmaddwd, or AVX512-VNNI's vpdpbusd, which gives the same integers in
   one instruction. Only the per-block scales are float. Products never saturate: the unsigned
   side is at most 128 (a magnitude of an int8) and the signed side within [-127, 127], so two
   products sum below 2^15 in vpmaddubsw.

   Every block layout and formula here follows ggml (ggml-quants.c, dequantize_row_* and
   ggml_vec_dot_*): tests/test_quant_kernels.py checks each type against the `gguf` package's
   own dequantizer. The vector code is 256 bits wide in every build; the AVX-512 builds differ
   only where VNNI replaces two instructions by one. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "simd.h"

#define QK 32   /* values per block of the 32-value types */
#define QKK 256 /* values per k-quant super-block */

typedef struct { uint16_t d; int8_t qs[QK]; } BlockQ8_0;
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } BlockQ4_0;
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } BlockQ4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } BlockQ5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } BlockQ5_1;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QKK / 2]; } BlockQ4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QKK / 8]; uint8_t qs[QKK / 2]; } BlockQ5_K;
typedef struct { uint8_t ql[QKK / 2]; uint8_t qh[QKK / 4]; int8_t scales[QKK / 16]; uint16_t d; } BlockQ6_K;

/* Activations: one block of 32 with a float scale and the sum of its values (Q8_0 and Q8_1 in
   one), and ggml's Q8_K. */
typedef struct { float d; int32_t sum; int8_t qs[QK]; } ActQ8;
typedef struct { float d; int8_t qs[QKK]; int16_t bsums[QKK / 16]; } ActQ8K;

_Static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 &&
               sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 && sizeof(BlockQ4_K) == 144 &&
               sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "ggml block sizes");

int64_t ggml_block_elements(int type) {
  switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_Q8_0: return QK;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return QKK;
    default: return 0;
  }
}

int64_t ggml_block_bytes(int type) {
  switch (type) {
    case GGML_Q4_0: return sizeof(BlockQ4_0);
    case GGML_Q4_1: return sizeof(BlockQ4_1);
    case GGML_Q5_0: return sizeof(BlockQ5_0);
    case GGML_Q5_1: return sizeof(BlockQ5_1);
    case GGML_Q8_0: return sizeof(BlockQ8_0);
    case GGML_Q4_K: return sizeof(BlockQ4_K);
    case GGML_Q5_K: return sizeof(BlockQ5_K);
    case GGML_Q6_K: return sizeof(BlockQ6_K);
    default: return 0;
  }
}

static inline int is_k_quant(int type) { return type >= GGML_Q4_K; }

static inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

/* ---- activations ------------------------------------------------------------------------- */

/* Q8_0 (ggml quantize_row_q8_0 with a float scale; the sum serves Q8_1's min term). */
static void quantize_q8(const float *x, ActQ8 *out, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, x += QK) {
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
      int v = (int)nearbyintf(x[i] * id);
      out[b].qs[i] = (int8_t)v;
      sum += v;
    }
    out[b].d = d;
    out[b].sum = sum;
  }
}

/* Q8_K (ggml quantize_row_q8_K_ref): the scale puts the value of largest magnitude at -127. */
static void quantize_q8k(const float *x, ActQ8K *out, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b, x += QKK) {
    float amax = 0.f, max = 0.f;
    for (int i = 0; i < QKK; ++i)
      if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    ActQ8K *o = out + b;
    if (amax == 0.f) {
      memset(o, 0, sizeof *o);
      continue;
    }
    const float iscale = -127.f / max;
    for (int i = 0; i < QKK; ++i) {
      int v = (int)nearbyintf(iscale * x[i]);
      o->qs[i] = (int8_t)(v > 127 ? 127 : v);
    }
    for (int s = 0; s < QKK / 16; ++s) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += o->qs[16 * s + i];
      o->bsums[s] = (int16_t)sum;
    }
    o->d = 1.f / iscale;
  }
}

/* ---- int8 dot products (256-bit) --------------------------------------------------------- */

/* acc + (sums of four u8 x s8 products) per int32 lane. */
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Sums of four s8 x s8 products per int32 lane: |a| times b with a's sign. */
static inline __m256i dot_s8s8(__m256i a, __m256i b) {
  return dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

/* 32 nibbles as bytes: the low nibbles (values 0..15) then the high ones (16..31). */
static inline __m256i nibbles32(const uint8_t *p) {
  __m128i lo = _mm_loadu_si128((const __m128i *)p);
  __m256i both = _mm256_set_m128i(_mm_srli_epi16(lo, 4), lo);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* 32 bits as 32 bytes, 0xFF where the bit is set (ggml's bytes_from_bits_32). */
static inline __m256i bits32(const uint8_t *p) {
  uint32_t bits;
  memcpy(&bits, p, sizeof bits);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static inline float hsum8(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

#define ACC(acc, scale, ints) acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(ints), acc)

/* One weight row of `blocks` 32-value blocks against one row of ActQ8. */
static float dot_q8_0(const void *w, const ActQ8 *a, int64_t blocks) {
  const BlockQ8_0 *b = (const BlockQ8_0 *)w;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i)
    ACC(acc, fp16(b[i].d) * a[i].d, dot_s8s8(load32(b[i].qs), load32(a[i].qs)));
  return hsum8(acc);
}

static float dot_q4_0(const void *w, const ActQ8 *a, int64_t blocks) {
  const BlockQ4_0 *b = (const BlockQ4_0 *)w;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    __m256i q = _mm256_sub_epi8(nibbles32(b[i].qs), _mm256_set1_epi8(8));
    ACC(acc, fp16(b[i].d) * a[i].d, dot_s8s8(q, load32(a[i].qs)));
  }
  return hsum8(acc);
}

static float dot_q5_0(const void *w, const ActQ8 *a, int64_t blocks) {
  const BlockQ5_0 *b = (const BlockQ5_0 *)w;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    /* q - 16 as int8: the nibble with 0xF0 or'd in where the fifth bit is clear. */
    __m256i high = _mm256_andnot_si256(bits32(b[i].qh), _mm256_set1_epi8((char)0xF0));
    __m256i q = _mm256_or_si256(nibbles32(b[i].qs), high);
    ACC(acc, fp16(b[i].d) * a[i].d, dot_s8s8(q, load32(a[i].qs)));
  }
  return hsum8(acc);
}

static float dot_q4_1(const void *w, const ActQ8 *a, int64_t blocks) {
  const BlockQ4_1 *b = (const BlockQ4_1 *)w;
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    __m256i p = dot_u8s8(_mm256_setzero_si256(), nibbles32(b[i].qs), load32(a[i].qs));
    ACC(acc, fp16(b[i].d) * a[i].d, p);
    mins += fp16(b[i].m) * a[i].d * (float)a[i].sum;
  }
  return hsum8(acc) + mins;
}

static float dot_q5_1(const void *w, const ActQ8 *a, int64_t blocks) {
  const BlockQ5_1 *b = (const BlockQ5_1 *)w;
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    __m256i high = _mm256_and_si256(bits32(b[i].qh), _mm256_set1_epi8(0x10));
    __m256i q = _mm256_or_si256(nibbles32(b[i].qs), high);
    ACC(acc, fp16(b[i].d) * a[i].d, dot_u8s8(_mm256_setzero_si256(), q, load32(a[i].qs)));
    mins += fp16(b[i].m) * a[i].d * (float)a[i].sum;
  }
  return hsum8(acc) + mins;
}

/* The 6-bit scales and mins of Q4_K / Q5_K's eight sub-blocks (ggml get_scale_min_k4). */
static inline void scales_mins_k4(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/* Sums of u8 x s8 products over 32 values, times an int16 scale, in eight int32 lanes. */
static inline __m256i scaled_dot(__m256i u, __m256i s, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16);
}

static float dot_q4_k(const void *w, const ActQ8K *a, int64_t blocks) {
  const BlockQ4_K *b = (const BlockQ4_K *)w;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t sc[8], mn[8];
    scales_mins_k4(b[i].scales, sc, mn);
    int32_t min_sum = 0;
    for (int j = 0; j < 8; ++j) min_sum += mn[j] * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i q = load32(b[i].qs + 32 * j);
      __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      sum = _mm256_add_epi32(sum, scaled_dot(lo, load32(a[i].qs + 64 * j), _mm256_set1_epi16(sc[2 * j])));
      sum = _mm256_add_epi32(sum, scaled_dot(hi, load32(a[i].qs + 64 * j + 32), _mm256_set1_epi16(sc[2 * j + 1])));
    }
    ACC(acc, fp16(b[i].d) * a[i].d, sum);
    mins += fp16(b[i].dmin) * a[i].d * (float)min_sum;
  }
  return hsum8(acc) - mins;
}

static float dot_q5_k(const void *w, const ActQ8K *a, int64_t blocks) {
  const BlockQ5_K *b = (const BlockQ5_K *)w;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    uint8_t sc[8], mn[8];
    scales_mins_k4(b[i].scales, sc, mn);
    int32_t min_sum = 0;
    for (int j = 0; j < 8; ++j) min_sum += mn[j] * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
    const __m256i high = load32(b[i].qh);
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i q = load32(b[i].qs + 32 * j);
      /* The fifth bit of value 64 j + l is bit 2 j of qh[l], of 64 j + 32 + l bit 2 j + 1. */
      __m256i hlo = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4);
      __m256i hhi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4);
      __m256i lo = _mm256_or_si256(_mm256_and_si256(q, low4), hlo);
      __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4), hhi);
      sum = _mm256_add_epi32(sum, scaled_dot(lo, load32(a[i].qs + 64 * j), _mm256_set1_epi16(sc[2 * j])));
      sum = _mm256_add_epi32(sum, scaled_dot(hi, load32(a[i].qs + 64 * j + 32), _mm256_set1_epi16(sc[2 * j + 1])));
    }
    ACC(acc, fp16(b[i].d) * a[i].d, sum);
    mins += fp16(b[i].dmin) * a[i].d * (float)min_sum;
  }
  return hsum8(acc) - mins;
}

static float dot_q6_k(const void *w, const ActQ8K *a, int64_t blocks) {
  const BlockQ6_K *b = (const BlockQ6_K *)w;
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const int8_t *sc = b[i].scales;
    /* Values are stored as q + 32 in 0..63: subtract 32 * (each sub-block's sum) after. */
    int32_t offset = 0;
    for (int s = 0; s < 16; ++s) offset += sc[s] * a[i].bsums[s];
    __m256i sum = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const uint8_t *ql = b[i].ql + 64 * half, *qh = b[i].qh + 32 * half;
      const int8_t *s = sc + 8 * half, *x = a[i].qs + 128 * half;
      __m256i la = load32(ql), lb = load32(ql + 32), h = load32(qh);
      __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(la, low4), _mm256_slli_epi16(_mm256_and_si256(h, two), 4)),
          _mm256_or_si256(_mm256_and_si256(lb, low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4)),
      };
      for (int k = 0; k < 4; ++k) {
        /* 32 values: the first 16 take scale s[2k], the next 16 s[2k + 1]. */
        __m256i scale = _mm256_set_m128i(_mm_set1_epi16(s[2 * k + 1]), _mm_set1_epi16(s[2 * k]));
        sum = _mm256_add_epi32(sum, scaled_dot(q[k], load32(x + 32 * k), scale));
      }
    }
    sum = _mm256_sub_epi32(sum, _mm256_setr_epi32(32 * offset, 0, 0, 0, 0, 0, 0, 0));
    ACC(acc, fp16(b[i].d) * a[i].d, sum);
  }
  return hsum8(acc);
}

typedef float (*DotFn)(const void *w, const void *a, int64_t blocks);

static DotFn dot_for(int type) {
  switch (type) {
    case GGML_Q4_0: return (DotFn)dot_q4_0;
    case GGML_Q4_1: return (DotFn)dot_q4_1;
    case GGML_Q5_0: return (DotFn)dot_q5_0;
    case GGML_Q5_1: return (DotFn)dot_q5_1;
    case GGML_Q8_0: return (DotFn)dot_q8_0;
    case GGML_Q4_K: return (DotFn)dot_q4_k;
    case GGML_Q5_K: return (DotFn)dot_q5_k;
    case GGML_Q6_K: return (DotFn)dot_q6_k;
    default: return NULL;
  }
}

/* ---- the threaded product ---------------------------------------------------------------- */

typedef struct {
  const uint8_t *W;
  DotFn dot;
  const uint8_t *xq; /* [m] rows of activation blocks */
  float *y;
  int64_t out, ldy, m, blocks, row_bytes, xq_row_bytes;
} QJob;

#define Q_ROWS_PER_CLAIM 32

static void qmatvec_block(const void *arg, int64_t claim) {
  const QJob *j = (const QJob *)arg;
  int64_t end = (claim + 1) * Q_ROWS_PER_CLAIM;
  if (end > j->out) end = j->out;
  for (int64_t o = claim * Q_ROWS_PER_CLAIM; o < end; ++o) {
    const uint8_t *w = j->W + o * j->row_bytes;
    for (int64_t r = 0; r < j->m; ++r)
      j->y[r * j->ldy + o] = j->dot(w, j->xq + r * j->xq_row_bytes, j->blocks);
  }
}

int qmatvec(const void *W, int type, const float *x, float *y, int64_t out, int64_t in,
            int64_t ldy, int64_t m, int threads) {
  const int64_t per_block = ggml_block_elements(type);
  DotFn dot = dot_for(type);
  if (!dot || m < 1 || out < 1 || in < 1 || in % per_block || ldy < out) return -1;
  const int64_t blocks = in / per_block;
  const int64_t act_bytes = is_k_quant(type) ? (int64_t)sizeof(ActQ8K) : (int64_t)sizeof(ActQ8);
  uint8_t *xq = malloc((size_t)(m * blocks * act_bytes));
  if (!xq) return -2;
  for (int64_t r = 0; r < m; ++r) {
    if (is_k_quant(type)) quantize_q8k(x + r * in, (ActQ8K *)(xq + r * blocks * act_bytes), blocks);
    else quantize_q8(x + r * in, (ActQ8 *)(xq + r * blocks * act_bytes), blocks);
  }
  QJob job = {(const uint8_t *)W, dot, xq, y, out, ldy, m, blocks, blocks * ggml_block_bytes(type),
              blocks * act_bytes};
  run_blocks(qmatvec_block, &job, (out + Q_ROWS_PER_CLAIM - 1) / Q_ROWS_PER_CLAIM, threads);
  free(xq);
  return 0;
}

/* ---- dequantization (embedding rows) ------------------------------------------------------ */

static void dequantize_block(const uint8_t *p, int type, float *y) {
  switch (type) {
    case GGML_Q8_0: {
      const BlockQ8_0 *b = (const BlockQ8_0 *)p;
      for (int i = 0; i < QK; ++i) y[i] = fp16(b->d) * b->qs[i];
      break;
    }
    case GGML_Q4_0: {
      const BlockQ4_0 *b = (const BlockQ4_0 *)p;
      for (int i = 0; i < QK / 2; ++i) {
        y[i] = fp16(b->d) * ((b->qs[i] & 0xF) - 8);
        y[i + QK / 2] = fp16(b->d) * ((b->qs[i] >> 4) - 8);
      }
      break;
    }
    case GGML_Q4_1: {
      const BlockQ4_1 *b = (const BlockQ4_1 *)p;
      for (int i = 0; i < QK / 2; ++i) {
        y[i] = fp16(b->d) * (b->qs[i] & 0xF) + fp16(b->m);
        y[i + QK / 2] = fp16(b->d) * (b->qs[i] >> 4) + fp16(b->m);
      }
      break;
    }
    case GGML_Q5_0: case GGML_Q5_1: {
      const int with_min = type == GGML_Q5_1;
      const uint8_t *qh = with_min ? ((const BlockQ5_1 *)p)->qh : ((const BlockQ5_0 *)p)->qh;
      const uint8_t *qs = with_min ? ((const BlockQ5_1 *)p)->qs : ((const BlockQ5_0 *)p)->qs;
      const float d = fp16(with_min ? ((const BlockQ5_1 *)p)->d : ((const BlockQ5_0 *)p)->d);
      const float m = with_min ? fp16(((const BlockQ5_1 *)p)->m) : -16.f * d;
      uint32_t h;
      memcpy(&h, qh, sizeof h);
      for (int i = 0; i < QK / 2; ++i) {
        y[i] = d * ((qs[i] & 0xF) | (((h >> i) & 1) << 4)) + m;
        y[i + QK / 2] = d * ((qs[i] >> 4) | (((h >> (i + 16)) & 1) << 4)) + m;
      }
      break;
    }
    case GGML_Q4_K: case GGML_Q5_K: {
      const int five = type == GGML_Q5_K;
      const BlockQ4_K *b4 = (const BlockQ4_K *)p;
      const BlockQ5_K *b5 = (const BlockQ5_K *)p;
      const float d = fp16(five ? b5->d : b4->d), dmin = fp16(five ? b5->dmin : b4->dmin);
      const uint8_t *qs = five ? b5->qs : b4->qs;
      uint8_t sc[8], mn[8];
      scales_mins_k4(five ? b5->scales : b4->scales, sc, mn);
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
          if (five) {
            lo |= ((b5->qh[l] >> (2 * j)) & 1) << 4;
            hi |= ((b5->qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          y[64 * j + l] = d * sc[2 * j] * lo - dmin * mn[2 * j];
          y[64 * j + 32 + l] = d * sc[2 * j + 1] * hi - dmin * mn[2 * j + 1];
        }
      break;
    }
    case GGML_Q6_K: {
      const BlockQ6_K *b = (const BlockQ6_K *)p;
      const float d = fp16(b->d);
      for (int half = 0; half < 2; ++half) {
        const uint8_t *ql = b->ql + 64 * half, *qh = b->qh + 32 * half;
        const int8_t *sc = b->scales + 8 * half;
        float *o = y + 128 * half;
        for (int l = 0; l < 32; ++l) {
          int is = l / 16;
          o[l] = d * sc[is] * (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          o[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          o[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          o[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
      break;
    }
  }
}

/* out[i] = row ids[i] of W [rows, in] in ggml `type`, as float32. 0, or -1 for a bad type, size
   or id (nothing is written past a bad id). */
int dequantize_rows(const void *W, int type, int64_t rows, int64_t in, const int64_t *ids,
                    int64_t n, float *out) {
  const int64_t per_block = ggml_block_elements(type);
  if (!per_block || in < 1 || in % per_block || n < 0) return -1;
  const int64_t block_bytes = ggml_block_bytes(type), blocks = in / per_block;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= rows) return -1;
    const uint8_t *row = (const uint8_t *)W + ids[i] * blocks * block_bytes;
    for (int64_t b = 0; b < blocks; ++b)
      dequantize_block(row + b * block_bytes, type, out + i * in + b * per_block);
  }
  return 0;
}
