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
   own dequantizer. The AVX2 build's tiles below are 256 bits wide; the AVX-512 builds compute
   every product with quant512.h's one formula over groups of 16 weight rows (strips, VNNI and
   AMX for prefill rows), and agree with each other to the bit. */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
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

/* ---- int8 helpers (256-bit) ------------------------------------------------------------- */

/* acc + (sums of four u8 x s8 products) per int32 lane. */
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
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


static inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 32 floats as int8 (saturating) in order: packs interleave 128-bit lanes, the permute undoes it. */
static inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __m256i round_to_int(__m256 v) {
  return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* ---- activations ------------------------------------------------------------------------- */

/* Q8_0 (ggml quantize_row_q8_0 with a float scale; the sum serves Q8_1's min term): d =
   max |x| / 127, q = round(x / d) to nearest even. */
static void quantize_q8(const float *x, ActQ8 *out, int64_t blocks) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b, x += QK) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(x + 8 * k);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float d = _mm_cvtss_f32(m) / 127.f, id = d ? 1.f / d : 0.f;
    __m256i q[4], total = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      q[k] = round_to_int(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
      total = _mm256_add_epi32(total, q[k]);
    }
    _mm256_storeu_si256((__m256i *)out[b].qs, pack32(q[0], q[1], q[2], q[3]));
    out[b].d = d;
    out[b].sum = hsum8i(total);
  }
}

/* Q8_K (ggml quantize_row_q8_K_ref): the scale puts the first value of largest magnitude at
   -127; bsums hold each 16 values' sum. */
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
    for (int k = 0; k < QKK / 32; ++k) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_min_epi32(round_to_int(_mm256_mul_ps(_mm256_set1_ps(iscale),
                                                           _mm256_loadu_ps(x + 32 * k + 8 * i))),
                                _mm256_set1_epi32(127));
      o->bsums[2 * k] = (int16_t)hsum8i(_mm256_add_epi32(q[0], q[1]));
      o->bsums[2 * k + 1] = (int16_t)hsum8i(_mm256_add_epi32(q[2], q[3]));
      _mm256_storeu_si256((__m256i *)(o->qs + 32 * k), pack32(q[0], q[1], q[2], q[3]));
    }
    o->d = 1.f / iscale;
  }
}

/* ---- tiles of weight rows against activation rows ----------------------------------------- */

#define NR_MAX 4 /* activation rows a tile takes */
#ifndef __AVX512F__
#define NW_TILE 2 /* weight rows a tile takes: 16 registers hold a 2 x 4 tile */
#endif

/* The 32-value types: a block unpacks to 32 weights, a float scale and, for the _1 types, a
   min. Q4_0 / Q5_0 stay unsigned (q, not q - 8 or q - 16): their offset times the activations'
   block sum goes into the int32 accumulator's first lane before the products, so no per-pair
   sign fix is needed. Q8_0 is signed: |w| times a with w's sign. */
typedef struct { __m256i q; float d, m; } Unpacked32;

static inline Unpacked32 unpack_q8_0(const void *p) {
  const BlockQ8_0 *b = (const BlockQ8_0 *)p;
  return (Unpacked32){load32(b->qs), fp16(b->d), 0.f};
}
static inline Unpacked32 unpack_q4_0(const void *p) {
  const BlockQ4_0 *b = (const BlockQ4_0 *)p;
  return (Unpacked32){nibbles32(b->qs), fp16(b->d), 0.f};
}
static inline Unpacked32 unpack_q5_0(const void *p) {
  const BlockQ5_0 *b = (const BlockQ5_0 *)p;
  __m256i high = _mm256_and_si256(bits32(b->qh), _mm256_set1_epi8(0x10));
  return (Unpacked32){_mm256_or_si256(nibbles32(b->qs), high), fp16(b->d), 0.f};
}
static inline Unpacked32 unpack_q4_1(const void *p) {
  const BlockQ4_1 *b = (const BlockQ4_1 *)p;
  return (Unpacked32){nibbles32(b->qs), fp16(b->d), fp16(b->m)};
}
static inline Unpacked32 unpack_q5_1(const void *p) {
  const BlockQ5_1 *b = (const BlockQ5_1 *)p;
  __m256i high = _mm256_and_si256(bits32(b->qh), _mm256_set1_epi8(0x10));
  return (Unpacked32){_mm256_or_si256(nibbles32(b->qs), high), fp16(b->d), fp16(b->m)};
}

/* A 32-value block unpacked ahead: a prefill chunk unpacks each claim's weight rows once into
   these, where the stored-block tiles unpacked every block again for each 4 activation rows
   (Q5_0, most of the default's matrices, ran at half Q8_0's rate: the unpacking was the
   work). The tiles read a Pre32 as they read the stored block (the same bytes and the same
   float scales), so a row's result is the same bits either way. */
typedef struct { uint8_t q[QK]; float d, m; } Pre32;
static inline Unpacked32 unpack_pre32(const void *p) {
  const Pre32 *b = (const Pre32 *)p;
  return (Unpacked32){load32(b->q), b->d, b->m};
}
#define unpack_pre_q4_0 unpack_pre32
#define unpack_pre_q5_0 unpack_pre32
#define unpack_pre_q4_1 unpack_pre32
#define unpack_pre_q5_1 unpack_pre32

/* A tile fetches the rows it will read PREFETCH_TILES tiles on while it computes: the hardware
   prefetcher alone kept the one-row product (decode) at a third of the memory bandwidth (a tile
   reads NW rows a line or so each at a time). Two tiles ahead measured best on the Xeon of
   issue 25 (the 262k x 640 Q8_0 head: 15 to ~8 ms a token on 2 threads). A prefetch never
   faults and reads nothing the program sees: past the matrix's end it does nothing. */
#define PREFETCH_TILES 2
static inline void prefetch_ahead(const uint8_t *p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

#ifndef __AVX512F__ /* AVX2's tiles (the AVX-512 builds' products are in quant512.h) */
/* A tile of NW weight rows (`wstride` bytes apart) against NR activation rows (`astride` apart):
   each weight block is unpacked once for the NR rows, each activation block loaded once for
   the NW rows. Every (weight row, activation row) pair runs the same operations in the same
   order whatever the tile, so a row's result does not depend on the rows computed beside it
   (a prefill chunk gives the answer its tokens get alone), nor on the build.
   out[w * NR_MAX + r]. */
#define DEFINE_TILE32(NAME, BLOCK, ZERO, SIGNED, HAS_MIN, NW, NR)                               \
  static void tile_##NAME##_##NW##x##NR(const uint8_t *w, int64_t wstride, const uint8_t *a,   \
                                        int64_t astride, int64_t blocks, float *out) {          \
    __m256 acc[NW][NR];                                                                         \
    float mins[NW][NR];                                                                         \
    for (int i = 0; i < NW; ++i)                                                                \
      for (int r = 0; r < NR; ++r) { acc[i][r] = _mm256_setzero_ps(); mins[i][r] = 0.f; }       \
    for (int64_t b = 0; b < blocks; ++b) {                                                      \
      Unpacked32 u[NW];                                                                         \
      __m256i mag[NW];                                                                          \
      __m256 dw[NW];                                                                            \
      for (int i = 0; i < NW; ++i) {                                                            \
        const uint8_t *row = w + i * wstride + b * (int64_t)sizeof(BLOCK);                      \
        prefetch_ahead(row + PREFETCH_TILES * NW * wstride, sizeof(BLOCK));                     \
        u[i] = unpack_##NAME(row);                                                              \
        mag[i] = SIGNED ? _mm256_sign_epi8(u[i].q, u[i].q) : u[i].q;                            \
        dw[i] = _mm256_set1_ps(u[i].d);                                                         \
      }                                                                                         \
      for (int r = 0; r < NR; ++r) {                                                            \
        const ActQ8 *x = (const ActQ8 *)(a + r * astride) + b;                                  \
        const __m256i xa = load32(x->qs);                                                       \
        const __m256i init = _mm256_setr_epi32(-(ZERO) * x->sum, 0, 0, 0, 0, 0, 0, 0);         \
        const __m256 dx = _mm256_set1_ps(x->d);                                                 \
        for (int i = 0; i < NW; ++i) {                                                          \
          __m256i p = SIGNED ? dot_u8s8(_mm256_setzero_si256(), mag[i], _mm256_sign_epi8(xa, u[i].q)) \
                             : dot_u8s8(init, mag[i], xa);                                      \
          acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(dw[i], dx), _mm256_cvtepi32_ps(p), acc[i][r]); \
          if (HAS_MIN) mins[i][r] += u[i].m * x->d * (float)x->sum;                             \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
    for (int i = 0; i < NW; ++i)                                                                \
      for (int r = 0; r < NR; ++r) out[i * NR_MAX + r] = hsum256(acc[i][r]) + mins[i][r];         \
  }

#endif /* AVX2's 32-value tiles */

/* The k-quants: a super-block unpacks to 8 x 32 weights (unsigned), an int16 scale for each
   32 (Q4_K / Q5_K: one per 32; Q6_K: one per 16, so each vector holds two), and the min
   term's int16 multipliers of the activations' 16-value sums. */
typedef struct { __m256i q[8], scale[8], mins; float d, dmin; } UnpackedK;

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

/* Q4_K / Q5_K's scales and mins (the min of sub-block j multiplies bsums 2j and 2j + 1). */
static inline void unpack_k4_scales(const uint8_t *packed, UnpackedK *u) {
  uint8_t sc[8], mn[8];
  scales_mins_k4(packed, sc, mn);
  for (int j = 0; j < 8; ++j) u->scale[j] = _mm256_set1_epi16(sc[j]);
  __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)mn));
  u->mins = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
}

static inline void unpack_q4_k(const void *p, UnpackedK *u) {
  const BlockQ4_K *b = (const BlockQ4_K *)p;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    __m256i q = load32(b->qs + 32 * j);
    u->q[2 * j] = _mm256_and_si256(q, low4);
    u->q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
  }
  unpack_k4_scales(b->scales, u);
  u->d = fp16(b->d);
  u->dmin = fp16(b->dmin);
}

static inline void unpack_q5_k(const void *p, UnpackedK *u) {
  const BlockQ5_K *b = (const BlockQ5_K *)p;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i high = load32(b->qh);
  for (int j = 0; j < 4; ++j) {
    __m256i q = load32(b->qs + 32 * j);
    /* The fifth bit of value 64 j + l is bit 2 j of qh[l], of 64 j + 32 + l bit 2 j + 1. */
    __m256i hlo = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4);
    __m256i hhi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4);
    u->q[2 * j] = _mm256_or_si256(_mm256_and_si256(q, low4), hlo);
    u->q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4), hhi);
  }
  unpack_k4_scales(b->scales, u);
  u->d = fp16(b->d);
  u->dmin = fp16(b->dmin);
}

/* Q6_K: values stored as q + 32 in 0..63, in the order of ggml's dequantize_row_q6_K; the
   32 * sum term is the min term with each 16-value sum times 32 * its scale. */
static inline void unpack_q6_k(const void *p, UnpackedK *u) {
  const BlockQ6_K *b = (const BlockQ6_K *)p;
  const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
  for (int half = 0; half < 2; ++half) {
    const uint8_t *ql = b->ql + 64 * half, *qh = b->qh + 32 * half;
    const int8_t *s = b->scales + 8 * half;
    __m256i la = load32(ql), lb = load32(ql + 32), h = load32(qh);
    __m256i *q = u->q + 4 * half;
    q[0] = _mm256_or_si256(_mm256_and_si256(la, low4), _mm256_slli_epi16(_mm256_and_si256(h, two), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(lb, low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4));
    for (int k = 0; k < 4; ++k) /* the first 16 values take scale s[2k], the next 16 s[2k + 1] */
      u->scale[4 * half + k] = _mm256_set_m128i(_mm_set1_epi16(s[2 * k + 1]), _mm_set1_epi16(s[2 * k]));
  }
  u->mins = _mm256_slli_epi16(
      _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales)), 5);
  u->d = u->dmin = fp16(b->d);
}

#ifndef __AVX512F__
#define DEFINE_TILE_K(NAME, BLOCK, NW, NR)                                                      \
  static void tile_##NAME##_##NW##x##NR(const uint8_t *w, int64_t wstride, const uint8_t *a,   \
                                        int64_t astride, int64_t blocks, float *out) {          \
    __m256 acc[NW][NR], acc_min[NW][NR];                                                        \
    for (int i = 0; i < NW; ++i)                                                                \
      for (int r = 0; r < NR; ++r) acc[i][r] = acc_min[i][r] = _mm256_setzero_ps();             \
    for (int64_t b = 0; b < blocks; ++b) {                                                      \
      UnpackedK u[NW];                                                                          \
      for (int i = 0; i < NW; ++i) {                                                            \
        const uint8_t *row = w + i * wstride + b * (int64_t)sizeof(BLOCK);                      \
        prefetch_ahead(row + PREFETCH_TILES * NW * wstride, sizeof(BLOCK));                     \
        unpack_##NAME(row, &u[i]);                                                              \
      }                                                                                         \
      for (int r = 0; r < NR; ++r) {                                                            \
        const ActQ8K *x = (const ActQ8K *)(a + r * astride) + b;                                \
        __m256i sum[NW];                                                                        \
        for (int i = 0; i < NW; ++i) sum[i] = _mm256_setzero_si256();                           \
        for (int k = 0; k < 8; ++k) {                                                           \
          const __m256i xa = load32(x->qs + 32 * k);                                            \
          for (int i = 0; i < NW; ++i)                                                          \
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(                                \
                _mm256_maddubs_epi16(u[i].q[k], xa), u[i].scale[k]));                           \
        }                                                                                       \
        const __m256i bsums = load32(x->bsums);                                                 \
        const __m256 dx = _mm256_set1_ps(x->d);                                                 \
        for (int i = 0; i < NW; ++i) {                                                          \
          __m256i mins = _mm256_madd_epi16(bsums, u[i].mins);                                   \
          acc[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(u[i].d), dx),                \
                                      _mm256_cvtepi32_ps(sum[i]), acc[i][r]);                   \
          acc_min[i][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(u[i].dmin), dx),         \
                                          _mm256_cvtepi32_ps(mins), acc_min[i][r]);             \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
    for (int i = 0; i < NW; ++i)                                                                \
      for (int r = 0; r < NR; ++r) out[i * NR_MAX + r] = hsum256(acc[i][r]) - hsum256(acc_min[i][r]); \
  }

typedef void (*TileFn)(const uint8_t *w, int64_t wstride, const uint8_t *a, int64_t astride,
                       int64_t blocks, float *out);

/* Every tile shape of a type: NW_TILE or 1 weight rows against 1 to NR_MAX activation rows. */
#define DEFINE_TILES(DEFINE, NAME, ...)                                                         \
  DEFINE(NAME, __VA_ARGS__, 1, 1) DEFINE(NAME, __VA_ARGS__, 1, 2)                               \
  DEFINE(NAME, __VA_ARGS__, 1, 3) DEFINE(NAME, __VA_ARGS__, 1, 4)                               \
  EXPANDED(DEFINE, NAME, __VA_ARGS__, NW_TILE, 1) EXPANDED(DEFINE, NAME, __VA_ARGS__, NW_TILE, 2) \
  EXPANDED(DEFINE, NAME, __VA_ARGS__, NW_TILE, 3) EXPANDED(DEFINE, NAME, __VA_ARGS__, NW_TILE, 4) \
  static const TileFn tiles_##NAME[2][NR_MAX] = {                                               \
      {tile_##NAME##_1x1, tile_##NAME##_1x2, tile_##NAME##_1x3, tile_##NAME##_1x4},             \
      {TILE_NAME(NAME, 1), TILE_NAME(NAME, 2), TILE_NAME(NAME, 3), TILE_NAME(NAME, 4)}};
#define EXPANDED(F, ...) F(__VA_ARGS__) /* NW_TILE as its number before it is pasted */
#define TILE_NAME_(NAME, NW, NR) tile_##NAME##_##NW##x##NR
#define TILE_NAME__(NAME, NW, NR) TILE_NAME_(NAME, NW, NR)
#define TILE_NAME(NAME, NR) TILE_NAME__(NAME, NW_TILE, NR)

/* NAME, block, offset of the unsigned values, signed, has a min */
DEFINE_TILES(DEFINE_TILE32, q8_0, BlockQ8_0, 0, 1, 0)
DEFINE_TILES(DEFINE_TILE32, q4_0, BlockQ4_0, 8, 0, 0)
DEFINE_TILES(DEFINE_TILE32, q5_0, BlockQ5_0, 16, 0, 0)
DEFINE_TILES(DEFINE_TILE32, q4_1, BlockQ4_1, 0, 0, 1)
DEFINE_TILES(DEFINE_TILE32, q5_1, BlockQ5_1, 0, 0, 1)
DEFINE_TILES(DEFINE_TILE32, pre_q4_0, Pre32, 8, 0, 0)
DEFINE_TILES(DEFINE_TILE32, pre_q5_0, Pre32, 16, 0, 0)
DEFINE_TILES(DEFINE_TILE32, pre_q4_1, Pre32, 0, 0, 1)
DEFINE_TILES(DEFINE_TILE32, pre_q5_1, Pre32, 0, 0, 1)
DEFINE_TILES(DEFINE_TILE_K, q4_k, BlockQ4_K)
DEFINE_TILES(DEFINE_TILE_K, q5_k, BlockQ5_K)
DEFINE_TILES(DEFINE_TILE_K, q6_k, BlockQ6_K)

static const TileFn (*tiles_for(int type))[NR_MAX] {
  switch (type) {
    case GGML_Q4_0: return tiles_q4_0;
    case GGML_Q4_1: return tiles_q4_1;
    case GGML_Q5_0: return tiles_q5_0;
    case GGML_Q5_1: return tiles_q5_1;
    case GGML_Q8_0: return tiles_q8_0;
    case GGML_Q4_K: return tiles_q4_k;
    case GGML_Q5_K: return tiles_q5_k;
    case GGML_Q6_K: return tiles_q6_k;
    default: return NULL;
  }
}
#endif /* AVX2's tiles */

/* Rows [0, rows) of stored blocks (`wstride` bytes apart) unpacked into Pre32 [rows][blocks]. */
typedef void (*PreUnpackFn)(const uint8_t *w, int64_t wstride, int64_t rows, int64_t blocks,
                            Pre32 *out);
#define DEFINE_PRE_UNPACK(NAME, BLOCK)                                                          \
  static void pre_unpack_##NAME(const uint8_t *w, int64_t wstride, int64_t rows,             \
                                int64_t blocks, Pre32 *out) {                                   \
    for (int64_t r = 0; r < rows; ++r)                                                          \
      for (int64_t b = 0; b < blocks; ++b) {                                                    \
        const Unpacked32 u = unpack_##NAME(w + r * wstride + b * (int64_t)sizeof(BLOCK));       \
        Pre32 *o = out + r * blocks + b;                                                        \
        _mm256_storeu_si256((__m256i *)o->q, u.q);                                              \
        o->d = u.d;                                                                             \
        o->m = u.m;                                                                             \
      }                                                                                         \
  }
DEFINE_PRE_UNPACK(q4_0, BlockQ4_0)
DEFINE_PRE_UNPACK(q5_0, BlockQ5_0)
DEFINE_PRE_UNPACK(q4_1, BlockQ4_1)
DEFINE_PRE_UNPACK(q5_1, BlockQ5_1)

/* The types a prefill unpacks ahead (Q8_0's unpacking is a load: nothing to gain; the
   k-quants not yet), their unpacking and their tiles over Pre32 rows. */
static PreUnpackFn pre_unpack_for(int type) {
  switch (type) {
    case GGML_Q4_0: return pre_unpack_q4_0;
    case GGML_Q5_0: return pre_unpack_q5_0;
    case GGML_Q4_1: return pre_unpack_q4_1;
    case GGML_Q5_1: return pre_unpack_q5_1;
    default: return NULL;
  }
}
#ifndef __AVX512F__
static const TileFn (*pre_tiles_for(int type))[NR_MAX] {
  switch (type) {
    case GGML_Q4_0: return tiles_pre_q4_0;
    case GGML_Q5_0: return tiles_pre_q5_0;
    case GGML_Q4_1: return tiles_pre_q4_1;
    case GGML_Q5_1: return tiles_pre_q5_1;
    default: return NULL;
  }
}
#endif

/* ---- the threaded product ---------------------------------------------------------------- */

typedef struct {
  const float *x;
  uint8_t *xq;
  int64_t in, blocks, act_bytes, m;
  int k_quant;
} QuantizeJob;

#define Q_ROWS_PER_QUANTIZE 8

static void quantize_block(const void *arg, int64_t claim) {
  const QuantizeJob *j = (const QuantizeJob *)arg;
  int64_t end = (claim + 1) * Q_ROWS_PER_QUANTIZE;
  if (end > j->m) end = j->m;
  for (int64_t r = claim * Q_ROWS_PER_QUANTIZE; r < end; ++r) {
    uint8_t *row = j->xq + r * j->blocks * j->act_bytes;
    if (j->k_quant) quantize_q8k(j->x + r * j->in, (ActQ8K *)row, j->blocks);
    else quantize_q8(j->x + r * j->in, (ActQ8 *)row, j->blocks);
  }
}

typedef struct {
  const uint8_t *W, *xq; /* the part's weights; its kind of activation rows */
  int type;
  int64_t first, count, claims_before; /* output rows [first, first + count); claims of earlier parts */
  int64_t claim_rows; /* output rows a claim takes (rows_per_claim) */
  int64_t row_bytes, xq_row_bytes, blocks;
  PreUnpackFn pre_unpack; /* NULL: the tiles read the stored blocks */
#ifndef __AVX512F__
  const TileFn (*tiles)[NR_MAX];
  const TileFn (*pre_tiles)[NR_MAX];
#endif
} QJobPart;

typedef struct {
  QJobPart parts[QMAX_PARTS];
  int nparts;
  float *y;
  int64_t ldy, m, in;
  /* AVX512-VNNI: prefill rows go through strips (quant512.h), reading the activations as
     unsigned bytes (x + 128), padded to a multiple of 16 rows: xs for Q8_0, xsk for Q8_K. */
  int strips;
  const uint8_t *xs, *xsk;
} QJob;

#define Q_ROWS_PER_CLAIM 32

/* Output rows a claim of one part takes: with more than FEW_ROWS activation rows (prefill),
   Q_ROWS_PER_CLAIM, the rows a thread unpacks once and reuses across every activation row;
   with fewer, few_rows_claim's (simd.h). Which rows a claim holds does not change a row's
   result (the tiles compute each pair alike). */
#ifndef __AVX512F__
/* Activation rows up to which the AVX2 build reads a weight tile once for all of them (a
   drafted row's check, a few rows verifying drafts together): the claim's tiles are walked
   once, each against every NR_MAX activation rows in turn while its weights are in L1, with
   the decode's claims and their prefetching. Walking the claim once per NR_MAX activation
   rows read the weights again on each pass. On a 2-core AMD EPYC (Zen 2), alternating
   before and after (benchmarks/results/few-rows-ab-epyc-zen2.md): a step of the default model
   with one row and 4, 8, 16 drafted tokens 44.1, 70.3-84.4, 117-118 ms before, 37.4-39.7,
   62.7-67.2, 107-113 after; the head alone at 5 rows 18.8 -> 17.0 ms. */
#define FEW_ROWS_MAX 32
#define FEW_ROWS(m) ((m) <= FEW_ROWS_MAX)
#else
#define FEW_ROWS(m) ((m) <= NR_MAX)
#endif

static int64_t rows_per_claim(int64_t rows, int64_t row_bytes, int64_t m, int threads) {
  return FEW_ROWS(m) ? few_rows_claim(rows, row_bytes, threads, Q_ROWS_PER_CLAIM, 1)
                     : Q_ROWS_PER_CLAIM;
}

/* 32 weight rows of one part against every activation row, NR_MAX at a time: those activation
   rows stay in L1 across the 32 weight rows, and the weight rows across the activation rows. */
/* This thread's strip of unpacked rows, grown to the largest claim (the pool's threads live
   as long as the process; a strip is at most Q_ROWS_PER_CLAIM rows of one matrix). */
static _Thread_local Pre32 *strip;
static _Thread_local int64_t strip_blocks;

static Pre32 *claim_strip(int64_t blocks) {
  if (blocks > strip_blocks) {
    Pre32 *grown = malloc((size_t)blocks * sizeof(Pre32));
    if (!grown) return NULL; /* the caller reads the stored blocks instead */
    free(strip);
    strip = grown;
    strip_blocks = blocks;
  }
  return strip;
}

/* A claim's part and its output rows [start, end) within the part. */
static inline const QJobPart *claim_rows(const QJob *j, int64_t claim, int64_t *start,
                                         int64_t *end) {
  int p = j->nparts - 1;
  while (p > 0 && claim < j->parts[p].claims_before) --p;
  const QJobPart *part = &j->parts[p];
  *start = (claim - part->claims_before) * part->claim_rows;
  *end = *start + part->claim_rows < part->count ? *start + part->claim_rows : part->count;
  return part;
}

/* The claim's weight rows as its tiles read them (`*wstride` bytes apart): stored, or, where
   they meet more than one tile of activation rows, unpacked once into this thread's Pre32
   strip (`*unpacked` set). */
static const uint8_t *claim_weights(const QJobPart *part, int64_t m, int64_t start, int64_t end,
                                    int64_t *wstride, int *unpacked) {
  const uint8_t *W = part->W + start * part->row_bytes;
  *wstride = part->row_bytes;
  Pre32 *pre = part->pre_unpack && !FEW_ROWS(m) ? claim_strip((end - start) * part->blocks)
                                                : NULL;
  *unpacked = pre != NULL;
  if (!pre) return W;
  part->pre_unpack(W, *wstride, end - start, part->blocks, pre);
  *wstride = part->blocks * (int64_t)sizeof(Pre32);
  return (const uint8_t *)pre;
}

#ifndef __AVX512F__
/* One tile: weight rows [o, o + nw) of the part (at `w`, `wstride` bytes apart) against
   activation rows [r0, r0 + nr), into the output. */
static inline void run_tile(const QJob *j, const QJobPart *part, const TileFn (*tiles)[NR_MAX],
                            const uint8_t *w, int64_t wstride, int64_t o, int nw, int64_t r0,
                            int nr) {
  float results[NW_TILE * NR_MAX];
  tiles[nw > 1][nr - 1](w, wstride, part->xq + r0 * part->xq_row_bytes, part->xq_row_bytes,
                        part->blocks, results);
  for (int i = 0; i < nw; ++i)
    for (int r = 0; r < nr; ++r)
      j->y[(r0 + r) * j->ldy + part->first + o + i] = results[i * NR_MAX + r];
}

static void qmatvec_block(const void *arg, int64_t claim) {
  const QJob *j = (const QJob *)arg;
  int64_t start, end;
  const QJobPart *part = claim_rows(j, claim, &start, &end);
  int64_t wstride;
  int unpacked;
  const uint8_t *W = claim_weights(part, j->m, start, end, &wstride, &unpacked);
  const TileFn(*tiles)[NR_MAX] = unpacked ? part->pre_tiles : part->tiles;
  if (j->m > NR_MAX && FEW_ROWS(j->m)) {
    /* weights outer: a tile's rows (unpacked once into this thread's strip, for the types
       that unpack ahead) meet every activation row before the next tile's are read */
    Pre32 *pair = part->pre_unpack ? claim_strip(NW_TILE * part->blocks) : NULL;
    const TileFn(*few)[NR_MAX] = pair ? part->pre_tiles : part->tiles;
    const int64_t pair_stride = part->blocks * (int64_t)sizeof(Pre32);
    for (int64_t o = start; o < end;) {
      const int nw = end - o >= NW_TILE ? NW_TILE : 1;
      const uint8_t *w = W + (o - start) * wstride;
      if (pair) part->pre_unpack(w, wstride, nw, part->blocks, pair);
      for (int64_t r0 = 0; r0 < j->m; r0 += NR_MAX)
        run_tile(j, part, few, pair ? (const uint8_t *)pair : w, pair ? pair_stride : wstride,
                 o, nw, r0, j->m - r0 < NR_MAX ? (int)(j->m - r0) : NR_MAX);
      o += nw;
    }
    return;
  }
  for (int64_t r0 = 0; r0 < j->m; r0 += NR_MAX) {
    const int nr = j->m - r0 < NR_MAX ? (int)(j->m - r0) : NR_MAX;
    for (int64_t o = start; o < end;) {
      const int nw = end - o >= NW_TILE ? NW_TILE : 1;
      run_tile(j, part, tiles, W + (o - start) * wstride, wstride, o, nw, r0, nr);
      o += nw;
    }
  }
}
int quant_amx(int want) { (void)want; return 0; }
/* The AVX2 build has no strips and no AMX: every product takes its tiles. */
int quant_amx_rule(int rule) { (void)rule; return 0; }
int quant_strips_above(int rows) { (void)rows; return 0; }
#else
/* Activation rows above which a product goes through strips (AVX512-VNNI builds); at or below,
   the stored blocks' path, a pass of NR_MAX rows at a time over weights unpacked once. Both give
   the same bits: only their speed differs (benchmarks/probes/strips_rule.py). 6: a step of the
   default model over 5 and 6 rows (a row verifying 4 or 5 drafts) took 35.4 and 38.3 ms on the
   stored blocks against 37.8 and 39.2 through strips; from 7 rows strips were faster (2-core
   Xeon, benchmarks/probes/verify_cost.py's step, 2026-12-05). */
#define STRIPS_ABOVE_DEFAULT 6
static _Atomic int strips_above = STRIPS_ABOVE_DEFAULT;
static _Atomic int amx_rule = 0; /* quant_amx_rule's */

int quant_amx_rule(int rule) {
  if (rule >= 0 && rule <= 2) atomic_store(&amx_rule, rule);
  return atomic_load(&amx_rule);
}

int quant_strips_above(int rows) {
  if (rows >= NR_MAX) atomic_store(&strips_above, rows);
  return atomic_load(&strips_above);
}

#include "quant512.h"
#endif

/* Rows up to which the caller quantizes activations itself: a pool dispatch costs more. */
#define QUANTIZE_INLINE_ROWS 4

static void quantize_rows(const float *x, uint8_t *xq, int64_t in, int64_t blocks,
                          int64_t act_bytes, int64_t m, int k_quant, int threads) {
  QuantizeJob job = {x, xq, in, blocks, act_bytes, m, k_quant};
  const int64_t claims = (m + Q_ROWS_PER_QUANTIZE - 1) / Q_ROWS_PER_QUANTIZE;
  if (m <= QUANTIZE_INLINE_ROWS) {
    for (int64_t c = 0; c < claims; ++c) quantize_block(&job, c);
  } else {
    run_blocks(quantize_block, &job, claims, threads);
  }
}

#ifdef __AVX512VNNI__
/* The activations as unsigned bytes (x + 128), rows [m16, in] with rows m and on zero. */
static uint8_t *unsigned_rows(const uint8_t *xq, int64_t row_bytes, int64_t m, int64_t m16,
                              int64_t in, int k_quant) {
  uint8_t *xs = aligned_alloc(64, (size_t)((m16 * in + 63) / 64 * 64));
  if (!xs) return NULL;
  const int64_t per_block = k_quant ? QKK : QK, blocks = in / per_block;
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t *qs = k_quant ? ((const ActQ8K *)(xq + r * row_bytes))[b].qs
                                 : ((const ActQ8 *)(xq + r * row_bytes))[b].qs;
      for (int64_t k = 0; k < per_block; k += 32)
        _mm256_storeu_si256((__m256i *)(xs + r * in + b * per_block + k),
                            _mm256_xor_si256(load32(qs + k), flip));
    }
  memset(xs + m * in, 0, (size_t)((m16 - m) * in));
  return xs;
}
#endif

int qmatvec_parts(const QPart *parts, int nparts, const float *x, float *y, int64_t ldy,
                  int64_t in, int64_t m, int threads) {
  if (nparts < 1 || nparts > QMAX_PARTS || m < 1 || in < 1) return -1;
  int kinds[2] = {0, 0}; /* Q8 (32-value types), Q8_K (k-quants) */
  for (int p = 0; p < nparts; ++p) {
    const int64_t per_block = ggml_block_elements(parts[p].type);
    if (!per_block || in % per_block || parts[p].rows < 1 ||
        parts[p].first < 0 || parts[p].first + parts[p].rows > ldy)
      return -1;
    kinds[is_k_quant(parts[p].type)] = 1;
  }
  const int64_t q8_bytes = (in / QK) * (int64_t)sizeof(ActQ8);
  const int64_t q8k_bytes = in % QKK ? 0 : (in / QKK) * (int64_t)sizeof(ActQ8K);
  uint8_t *xq = malloc((size_t)(m * ((kinds[0] ? q8_bytes : 0) + (kinds[1] ? q8k_bytes : 0))));
  if (!xq) return -2;
  uint8_t *q8 = xq, *q8k = xq + (kinds[0] ? m * q8_bytes : 0);
  if (kinds[0]) quantize_rows(x, q8, in, in / QK, sizeof(ActQ8), m, 0, threads);
  if (kinds[1]) quantize_rows(x, q8k, in, in / QKK, sizeof(ActQ8K), m, 1, threads);
  QJob job = {.nparts = nparts, .y = y, .ldy = ldy, .m = m, .in = in};
  uint8_t *xs = NULL, *xsk = NULL;
#ifdef __AVX512VNNI__
  if (m > atomic_load(&strips_above)) {
    const int64_t m16 = (m + 15) / 16 * 16;
    xs = kinds[0] ? unsigned_rows(q8, q8_bytes, m, m16, in, 0) : NULL;
    xsk = kinds[1] ? unsigned_rows(q8k, q8k_bytes, m, m16, in, 1) : NULL;
    job.strips = (!kinds[0] || xs) && (!kinds[1] || xsk); /* else the stored blocks' path */
    job.xs = xs;
    job.xsk = xsk;
  }
#endif
  int64_t claims = 0;
  for (int p = 0; p < nparts; ++p) {
    const int k = is_k_quant(parts[p].type);
    const int64_t blocks = in / ggml_block_elements(parts[p].type);
    const int64_t row_bytes = blocks * ggml_block_bytes(parts[p].type);
    const int64_t claim_rows = rows_per_claim(parts[p].rows, row_bytes, m, threads);
    job.parts[p] = (QJobPart){.W = (const uint8_t *)parts[p].W, .xq = k ? q8k : q8,
                              .type = parts[p].type, .first = parts[p].first,
                              .count = parts[p].rows, .claims_before = claims,
                              .claim_rows = claim_rows, .row_bytes = row_bytes,
                              .xq_row_bytes = k ? q8k_bytes : q8_bytes, .blocks = blocks,
                              .pre_unpack = pre_unpack_for(parts[p].type),
#ifndef __AVX512F__
                              .tiles = tiles_for(parts[p].type),
                              .pre_tiles = pre_tiles_for(parts[p].type),
#endif
    };
    claims += (parts[p].rows + claim_rows - 1) / claim_rows;
  }
  run_blocks(qmatvec_block, &job, claims, threads);
  free(xs);
  free(xsk);
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
