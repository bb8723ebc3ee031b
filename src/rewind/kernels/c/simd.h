/* Vector helpers shared by the CPU kernels: AVX-512 where the build enables it, else AVX2. */
#ifndef REWIND_SIMD_H
#define REWIND_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { FORM_F32 = 0, FORM_BF16 = 1, FORM_INT8 = 2 };

/* The sum of a 256-bit vector's 8 floats (every build: quant.c works in 256-bit halves). */
static inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#ifdef __AVX512F__
#define XG 4 /* activation rows per pass */
#define VW 16
typedef __m512 vf;
static inline vf ld_bf16(const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline vf ld_i8(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define LDF(p) _mm512_loadu_ps(p)
#define STF(p, v) _mm512_storeu_ps(p, v)
#define SET1(x) _mm512_set1_ps(x)
#define ADD(a, b) _mm512_add_ps(a, b)
#define SUB(a, b) _mm512_sub_ps(a, b)
#define MUL(a, b) _mm512_mul_ps(a, b)
#define DIV(a, b) _mm512_div_ps(a, b)
#define MAX(a, b) _mm512_max_ps(a, b)
#define MIN(a, b) _mm512_min_ps(a, b)
#define FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c) /* c - a * b */
static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vround(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf pow2i(vf n) { /* 2^n for integral n in [-126, 127] */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vf zero_below(vf y, vf x, float bound) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GE_OQ), y);
}
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ZERO() _mm512_setzero_ps()
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#else
#define XG 2
#define VW 8
typedef __m256 vf;
static inline vf ld_bf16(const uint16_t *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline vf ld_i8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define LDF(p) _mm256_loadu_ps(p)
#define STF(p, v) _mm256_storeu_ps(p, v)
#define SET1(x) _mm256_set1_ps(x)
#define ADD(a, b) _mm256_add_ps(a, b)
#define SUB(a, b) _mm256_sub_ps(a, b)
#define MUL(a, b) _mm256_mul_ps(a, b)
#define DIV(a, b) _mm256_div_ps(a, b)
#define MAX(a, b) _mm256_max_ps(a, b)
#define MIN(a, b) _mm256_min_ps(a, b)
#define FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c) /* c - a * b */
static inline float hmax(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
static inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf pow2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf zero_below(vf y, vf x, float bound) {
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GE_OQ));
}
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ZERO() _mm256_setzero_ps()
static inline float hsum(vf v) { return hsum256(v); }
#endif

static inline float weight_at(const void *w, int form, int64_t i) {
  if (form == FORM_INT8) return (float)((const int8_t *)w)[i];
  if (form == FORM_F32) return ((const float *)w)[i];
  uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline vf load_weights(const void *w, int form, int64_t i) {
  if (form == FORM_BF16) return ld_bf16((const uint16_t *)w + i);
  if (form == FORM_INT8) return ld_i8((const int8_t *)w + i);
  return LDF((const float *)w + i);
}

/* e^x to ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n); 0 below
   -87.3 (and for -inf), where the true value is a denormal no softmax weight can use. */
static inline vf vexp(vf x) {
  const float bound = -87.3365478515625f;
  vf xc = MIN(MAX(x, SET1(bound)), SET1(88.0f)); /* n <= 127: no overflow */
  vf n = vround(MUL(xc, SET1(1.44269504088896341f)));
  vf r = FNMA(n, SET1(0.693359375f), xc);
  r = FNMA(n, SET1(-2.12194440e-4f), r);
  vf y = SET1(1.9875691500E-4f);
  y = FMA(y, r, SET1(1.3981999507E-3f));
  y = FMA(y, r, SET1(8.3334519073E-3f));
  y = FMA(y, r, SET1(4.1665795894E-2f));
  y = FMA(y, r, SET1(1.6666665459E-1f));
  y = FMA(y, r, SET1(5.0000001201E-1f));
  y = FMA(y, MUL(r, r), ADD(r, SET1(1.0f)));
  return zero_below(MUL(y, pow2i(n)), x, bound);
}

/* fn(args, b) for b in [0, blocks), spread over up to `threads` threads (pool.c). */
typedef void (*BlockFn)(const void *args, int64_t block);
void run_blocks(BlockFn fn, const void *args, int64_t blocks, int threads);

/* Output rows a claim takes in a product of a few activation rows (decode, a drafted row's
   check), where each weight is read once: each claim costs two atomics on lines every thread
   writes (run_blocks) and a fresh start of the hardware prefetcher, so about CLAIMS_PER_THREAD
   claims a thread, none over CLAIM_BYTES_MAX of weights, none under `least` rows (the size a
   product of many rows takes), a multiple of `multiple`. On a 2-core AMD EPYC (Zen 2) the
   default model's 262k-row head in 32-row claims took 10.3 ms on 2 threads (15.5 on one),
   in these 8.2 ms. */
#define CLAIMS_PER_THREAD 8
#define CLAIM_BYTES_MAX (1 << 20)
static inline int64_t few_rows_claim(int64_t rows, int64_t row_bytes, int threads,
                                     int64_t least, int64_t multiple) {
  const int64_t spread = (int64_t)(threads > 1 ? threads : 1) * CLAIMS_PER_THREAD;
  int64_t claim = (rows + spread - 1) / spread;
  const int64_t cap = CLAIM_BYTES_MAX / row_bytes;
  if (claim > cap) claim = cap;
  claim = (claim + multiple - 1) / multiple * multiple;
  return claim > least ? claim : least;
}

#endif
