/* The AVX-512 builds' products over ggml blocks (included by quant.c): one formula per output,
   three ways to get its integers.

   Why: a prefill spent ~3/4 of its time in quant.c's tiles, and 3/4 of a tile's instructions
   were the float work around each int8 product (a multiply, a conversion and an fma for every
   64 weights of one output). Here every block's integer is finished first, for 16 weight rows
   at once, and the float step runs once per block over a vector of 16 outputs. That also lets
   a prefill hand the int8 products to AMX (Sapphire Rapids and later), whose tiles do 16 x 16
   outputs of a 32-value block in one instruction, or to AVX512-VNNI with the activations
   broadcast (no reduction at all), and still give every output the same bits.

   The formula, for weight row w and activation row r (each output alone, in block order):
     32-value types: I_b = sum_k (q_k - zero) x_k, exact in int32;
       acc = fma(d_w,b * dx_r,b, (float)I_b, acc); with a min: accm = fma(m_w,b * dx_r,b,
       (float)sum(x)_r,b, accm); out = acc + accm.
     k-quants: I = sum over sub-blocks of scale * (q . x), M = sum_j bsums_j * min_j (int32);
       acc = fma(d * dx, (float)I, acc); accm = fma(dmin * dx, (float)M, accm); out = acc - accm.
   Integers are exact whichever instructions sum them, so the three producers below give an
   output the same bits, and a row's result never depends on the rows computed beside it (the
   engine's cached-against-uncached and batched-against-alone equivalences need that):
     - stored blocks (any m; decode): 16 rows' blocks unpacked, the int8 products summed per row
       (vpdpbusd or vpmaddubsw), the 16 rows' partial sums reduced into one vector;
     - a strip (prefill, VNNI): each claim's weight rows unpacked once into 16-row groups laid
       out as AMX's B tiles (4 values of one row in each 32-bit lane), then vpdpbusd with 4
       activation bytes broadcast gives a block's 16 integers in 8 instructions;
     - the same strip through AMX (TDPBUSD): 16 activation rows x 16 weight rows a block.
   The broadcast and AMX products need the activations unsigned: they read x + 128 (x ^ 0x80)
   and subtract 128 * sum(w) per row and block, kept in the strip. */

#define GROUP 16 /* weight rows of a group: the lanes of a float vector */
#define PREFETCH_GROUPS 1

/* 16 rows' int32 partial sums (8 each) as one vector of their totals, rows in order. */
static inline __m512i sum16x8(const __m256i v[GROUP]) {
  __m512i z[8];
  for (int k = 0; k < 4; ++k) {
    z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(v[k]), v[k + 4], 1);
    z[k + 4] = _mm512_inserti64x4(_mm512_castsi256_si512(v[k + 8]), v[k + 12], 1);
  }
  __m512i y[4];
  for (int k = 0; k < 4; ++k)
    y[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * k], z[2 * k + 1]),
                            _mm512_unpackhi_epi32(z[2 * k], z[2 * k + 1]));
  const __m512i x0 = _mm512_add_epi32(_mm512_unpacklo_epi64(y[0], y[1]), _mm512_unpackhi_epi64(y[0], y[1]));
  const __m512i x1 = _mm512_add_epi32(_mm512_unpacklo_epi64(y[2], y[3]), _mm512_unpackhi_epi64(y[2], y[3]));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __mmask16 first_lanes(int n) { return (__mmask16)((1u << n) - 1u); }

/* The group's 16 row pointers; rows past `nw` read the last real row (their lanes are dropped). */
static inline void group_rows(const uint8_t *w, int64_t wstride, int nw, const uint8_t *row[GROUP]) {
  for (int i = 0; i < GROUP; ++i) row[i] = w + (int64_t)(i < nw ? i : nw - 1) * wstride;
}

/* Byte offsets of the group's rows from its first (rows past `nw` repeat the last). */
static inline __m512i group_offsets(int nw, int64_t wstride) {
  const __m512i i = _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(nw - 1));
  return _mm512_mullo_epi32(i, _mm512_set1_epi32((int32_t)wstride));
}

/* The 16 rows' scales at byte `offset` of their blocks in one gather: fp16 in the low (or,
   HIGH, the high) half of the 32-bit word there, or a float. Sixteen scalar conversions stored
   and loaded back as a vector stalled the load (the one-row product of Q5_0 ran 1.3x slower). */
static inline __m512 gather_scales(const uint8_t *base, __m512i offsets, int offset, int kind) {
  if (kind == 2) return _mm512_i32gather_ps(offsets, base + offset, 1);
  __m512i words = _mm512_i32gather_epi32(offsets, base + offset, 1);
  if (kind == 1) words = _mm512_srli_epi32(words, 16);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}
enum { SCALE_FP16_LOW = 0, SCALE_FP16_HIGH = 1, SCALE_FLOAT = 2 };

/* ---- stored blocks (or Pre32 rows): nr <= NR_MAX activation rows ------------------------- */

/* D_AT, M_AT: where a block's scale and min are (an offset and a gather_scales kind). */
#define DEFINE_GROUP32(NAME, BLOCK, ZERO, SIGNED, HAS_MIN, D_AT, M_AT)                          \
  static void group_##NAME(const uint8_t *w, int64_t wstride, int nw, const uint8_t *a,        \
                           int64_t astride, int nr, int64_t blocks, float *y, int64_t ldy) {    \
    const uint8_t *row[GROUP];                                                                  \
    group_rows(w, wstride, nw, row);                                                            \
    const __m512i offsets = group_offsets(nw, wstride);                                         \
    __m512 acc[NR_MAX], accm[NR_MAX];                                                           \
    for (int r = 0; r < NR_MAX; ++r) acc[r] = accm[r] = _mm512_setzero_ps();                    \
    for (int64_t b = 0; b < blocks; ++b) {                                                      \
      __m256i q[GROUP], mag[GROUP];                                                             \
      for (int i = 0; i < GROUP; ++i) {                                                         \
        const uint8_t *p = row[i] + b * (int64_t)sizeof(BLOCK);                                 \
        prefetch_ahead(p + PREFETCH_GROUPS * GROUP * wstride, sizeof(BLOCK));                   \
        q[i] = unpack_##NAME(p).q;                                                              \
        mag[i] = SIGNED ? _mm256_sign_epi8(q[i], q[i]) : q[i];                                  \
      }                                                                                         \
      const uint8_t *first = w + b * (int64_t)sizeof(BLOCK);                                    \
      const __m512 dv = gather_scales(first, offsets, D_AT);                                    \
      const __m512 mv = HAS_MIN ? gather_scales(first, offsets, M_AT) : _mm512_setzero_ps();    \
      for (int r = 0; r < NR_MAX; ++r) {                                                        \
        if (r >= nr) break;                                                                     \
        const ActQ8 *x = (const ActQ8 *)(a + r * astride) + b;                                  \
        const __m256i xa = load32(x->qs);                                                       \
        const __m256i init = _mm256_setr_epi32(-(ZERO) * x->sum, 0, 0, 0, 0, 0, 0, 0);         \
        __m256i p[GROUP];                                                                       \
        for (int i = 0; i < GROUP; ++i)                                                         \
          p[i] = SIGNED ? dot_u8s8(_mm256_setzero_si256(), mag[i], _mm256_sign_epi8(xa, q[i]))  \
                        : dot_u8s8(init, mag[i], xa);                                           \
        const __m512 dx = _mm512_set1_ps(x->d);                                                 \
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dx), _mm512_cvtepi32_ps(sum16x8(p)), acc[r]); \
        if (HAS_MIN)                                                                            \
          accm[r] = _mm512_fmadd_ps(_mm512_mul_ps(mv, dx), _mm512_set1_ps((float)x->sum), accm[r]); \
      }                                                                                         \
    }                                                                                           \
    for (int r = 0; r < nr && r < NR_MAX; ++r)                                                  \
      _mm512_mask_storeu_ps(y + r * ldy, first_lanes(nw), _mm512_add_ps(acc[r], accm[r]));     \
  }

#define FP16_AT_0 0, SCALE_FP16_LOW
#define FP16_AT_2 0, SCALE_FP16_HIGH
#define PRE_D offsetof(Pre32, d), SCALE_FLOAT
#define PRE_M offsetof(Pre32, m), SCALE_FLOAT
DEFINE_GROUP32(q8_0, BlockQ8_0, 0, 1, 0, FP16_AT_0, FP16_AT_0)
DEFINE_GROUP32(q4_0, BlockQ4_0, 8, 0, 0, FP16_AT_0, FP16_AT_0)
DEFINE_GROUP32(q5_0, BlockQ5_0, 16, 0, 0, FP16_AT_0, FP16_AT_0)
DEFINE_GROUP32(q4_1, BlockQ4_1, 0, 0, 1, FP16_AT_0, FP16_AT_2)
DEFINE_GROUP32(q5_1, BlockQ5_1, 0, 0, 1, FP16_AT_0, FP16_AT_2)
DEFINE_GROUP32(pre_q4_0, Pre32, 8, 0, 0, PRE_D, PRE_M)
DEFINE_GROUP32(pre_q5_0, Pre32, 16, 0, 0, PRE_D, PRE_M)
DEFINE_GROUP32(pre_q4_1, Pre32, 0, 0, 1, PRE_D, PRE_M)
DEFINE_GROUP32(pre_q5_1, Pre32, 0, 0, 1, PRE_D, PRE_M)

#define DEFINE_GROUPK(NAME, BLOCK, D_AT, DMIN_AT)                                               \
  static void group_##NAME(const uint8_t *w, int64_t wstride, int nw, const uint8_t *a,        \
                           int64_t astride, int nr, int64_t blocks, float *y, int64_t ldy) {    \
    const uint8_t *row[GROUP];                                                                  \
    group_rows(w, wstride, nw, row);                                                            \
    const __m512i offsets = group_offsets(nw, wstride);                                         \
    __m512 acc[NR_MAX], accm[NR_MAX];                                                           \
    for (int r = 0; r < NR_MAX; ++r) acc[r] = accm[r] = _mm512_setzero_ps();                    \
    for (int64_t b = 0; b < blocks; ++b) {                                                      \
      __m256i sums[NR_MAX][GROUP], mins[NR_MAX][GROUP];                                         \
      for (int i = 0; i < GROUP; ++i) {                                                         \
        const uint8_t *p = row[i] + b * (int64_t)sizeof(BLOCK);                                 \
        prefetch_ahead(p + PREFETCH_GROUPS * GROUP * wstride, sizeof(BLOCK));                   \
        UnpackedK u;                                                                            \
        unpack_##NAME(p, &u);                                                                   \
        for (int r = 0; r < NR_MAX; ++r) {                                                      \
          if (r >= nr) break;                                                                   \
          const ActQ8K *x = (const ActQ8K *)(a + r * astride) + b;                              \
          __m256i s = _mm256_setzero_si256();                                                   \
          for (int k = 0; k < 8; ++k)                                                           \
            s = _mm256_add_epi32(s, _mm256_madd_epi16(                                          \
                _mm256_maddubs_epi16(u.q[k], load32(x->qs + 32 * k)), u.scale[k]));             \
          sums[r][i] = s;                                                                       \
          mins[r][i] = _mm256_madd_epi16(load32(x->bsums), u.mins);                             \
        }                                                                                       \
      }                                                                                         \
      const uint8_t *first = w + b * (int64_t)sizeof(BLOCK);                                    \
      const __m512 dv = gather_scales(first, offsets, D_AT);                                    \
      const __m512 dminv = gather_scales(first, offsets, DMIN_AT);                              \
      for (int r = 0; r < NR_MAX; ++r) {                                                        \
        if (r >= nr) break;                                                                     \
        const __m512 dx = _mm512_set1_ps(((const ActQ8K *)(a + r * astride) + b)->d);           \
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dx), _mm512_cvtepi32_ps(sum16x8(sums[r])), acc[r]); \
        accm[r] = _mm512_fmadd_ps(_mm512_mul_ps(dminv, dx), _mm512_cvtepi32_ps(sum16x8(mins[r])), accm[r]); \
      }                                                                                         \
    }                                                                                           \
    for (int r = 0; r < nr && r < NR_MAX; ++r)                                                  \
      _mm512_mask_storeu_ps(y + r * ldy, first_lanes(nw), _mm512_sub_ps(acc[r], accm[r]));     \
  }

/* Q6_K's d is its last 2 bytes: read as the high half of the word 2 bytes before. */
#define Q6K_D offsetof(BlockQ6_K, d) - 2, SCALE_FP16_HIGH
DEFINE_GROUPK(q4_k, BlockQ4_K, FP16_AT_0, FP16_AT_2)
DEFINE_GROUPK(q5_k, BlockQ5_K, FP16_AT_0, FP16_AT_2)
DEFINE_GROUPK(q6_k, BlockQ6_K, Q6K_D, Q6K_D)

typedef void (*GroupFn)(const uint8_t *w, int64_t wstride, int nw, const uint8_t *a,
                        int64_t astride, int nr, int64_t blocks, float *y, int64_t ldy);

static GroupFn group_for(int type, int pre) {
  switch (type) {
    case GGML_Q8_0: return group_q8_0;
    case GGML_Q4_0: return pre ? group_pre_q4_0 : group_q4_0;
    case GGML_Q5_0: return pre ? group_pre_q5_0 : group_q5_0;
    case GGML_Q4_1: return pre ? group_pre_q4_1 : group_q4_1;
    case GGML_Q5_1: return pre ? group_pre_q5_1 : group_q5_1;
    case GGML_Q4_K: return group_q4_k;
    case GGML_Q5_K: return group_q5_k;
    case GGML_Q6_K: return group_q6_k;
    default: return NULL;
  }
}

#ifdef __AVX512VNNI__
/* ---- strips: a claim's rows unpacked once, in AMX's B-tile layout ------------------------- */

/* One 32-value block of a 16-row group: q[t][i][j] = value 4 t + j of row i, signed (q - zero),
   and -128 * the row's sum of values (the unsigned activations' offset). */
typedef struct {
  int8_t q[QK / 4][GROUP][4];
  int32_t offset[GROUP];
  float d[GROUP], m[GROUP];
} __attribute__((aligned(64))) Strip32;

/* One super-block of a 16-row group. Sub-blocks of 32 values (Q4_K, Q5_K) or 16 (Q6_K), each
   with its scale; offset = -128 * sum over sub-blocks of scale * the sub-block's sum of values;
   min[p][i] = the multipliers of bsums 2p and 2p + 1. */
typedef struct {
  int8_t q[QKK / 4][GROUP][4];
  int32_t scale[QKK / 16][GROUP];
  int32_t offset[GROUP];
  int16_t min[QKK / 32][GROUP][2];
  float d[GROUP], dmin[GROUP];
} __attribute__((aligned(64))) StripK;

static inline int sub_values(int type) { return type == GGML_Q6_K ? 16 : 32; }

/* 16 rows of 32 bytes as 8 vectors: out[t] lane i = bytes 4 t .. 4 t + 3 of row i (two 8 x 8
   transposes of 32-bit words side by side: rows 0-7 in the low halves, 8-15 in the high). */
static inline void transpose_rows(const __m256i q[GROUP], __m512i out[8]) {
  __m512i r[8], t[8], u[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm512_inserti64x4(_mm512_castsi256_si512(q[k]), q[k + 8], 1);
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; ++k) { /* rows 4 k .. 4 k + 3 */
    u[4 * k + 0] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);     /* words 0 and 4 */
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);     /* 1 and 5 */
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]); /* 2 and 6 */
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]); /* 3 and 7 */
  }
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int w = 0; w < 4; ++w) {
    out[w] = _mm512_permutex2var_epi64(u[w], low, u[4 + w]);
    out[w + 4] = _mm512_permutex2var_epi64(u[w], high, u[4 + w]);
  }
}

/* Each lane's sum of the signed bytes of out[from .. to). */
static inline __m512i lane_sums(const __m512i *out, int from, int to) {
  __m512i sum = _mm512_setzero_si512();
  for (int t = from; t < to; ++t) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), out[t]);
  return sum;
}

static inline __m512i times_minus_128(__m512i v) {
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(v, 7));
}

#define DEFINE_STRIP32(NAME, BLOCK, ZERO, SIGNED)                                               \
  static void strip_##NAME(const uint8_t *w, int64_t wstride, int nw, int64_t blocks,         \
                           Strip32 *out) {                                                      \
    const uint8_t *row[GROUP];                                                                  \
    group_rows(w, wstride, nw, row);                                                            \
    for (int64_t b = 0; b < blocks; ++b) {                                                      \
      __m256i q[GROUP];                                                                         \
      for (int i = 0; i < GROUP; ++i) {                                                         \
        const Unpacked32 u = unpack_##NAME(row[i] + b * (int64_t)sizeof(BLOCK));               \
        q[i] = SIGNED ? u.q : _mm256_sub_epi8(u.q, _mm256_set1_epi8(ZERO));                     \
        out[b].d[i] = u.d;                                                                      \
        out[b].m[i] = u.m;                                                                      \
      }                                                                                         \
      __m512i t[8];                                                                             \
      transpose_rows(q, t);                                                                     \
      for (int k = 0; k < 8; ++k) _mm512_store_si512(out[b].q[k], t[k]);                        \
      _mm512_store_si512(out[b].offset, times_minus_128(lane_sums(t, 0, 8)));                   \
    }                                                                                           \
  }
DEFINE_STRIP32(q8_0, BlockQ8_0, 0, 1)
DEFINE_STRIP32(q4_0, BlockQ4_0, 8, 0)
DEFINE_STRIP32(q5_0, BlockQ5_0, 16, 0)
DEFINE_STRIP32(q4_1, BlockQ4_1, 0, 0)
DEFINE_STRIP32(q5_1, BlockQ5_1, 0, 0)

#define DEFINE_STRIPK(NAME, BLOCK)                                                              \
  static void strip_##NAME(const uint8_t *w, int64_t wstride, int nw, int64_t blocks,         \
                           StripK *out, int sub) {                                              \
    const uint8_t *row[GROUP];                                                                  \
    group_rows(w, wstride, nw, row);                                                            \
    for (int64_t b = 0; b < blocks; ++b) {                                                      \
      UnpackedK u[GROUP];                                                                       \
      for (int i = 0; i < GROUP; ++i) {                                                         \
        unpack_##NAME(row[i] + b * (int64_t)sizeof(BLOCK), &u[i]);                              \
        out[b].d[i] = u[i].d;                                                                   \
        out[b].dmin[i] = u[i].dmin;                                                             \
        int16_t mins[16];                                                                       \
        _mm256_storeu_si256((__m256i *)mins, u[i].mins);                                        \
        for (int p = 0; p < 8; ++p) {                                                           \
          out[b].min[p][i][0] = mins[2 * p];                                                    \
          out[b].min[p][i][1] = mins[2 * p + 1];                                                \
        }                                                                                       \
      }                                                                                         \
      __m512i offset = _mm512_setzero_si512();                                                  \
      for (int k = 0; k < 8; ++k) { /* values 32 k .. 32 k + 31 */                             \
        __m256i q[GROUP];                                                                       \
        int32_t scales[2][GROUP]; /* of values 32 k and 32 k + 16 (one int16 per pair) */      \
        for (int i = 0; i < GROUP; ++i) {                                                       \
          q[i] = u[i].q[k];                                                                     \
          scales[0][i] = (int16_t)_mm256_extract_epi16(u[i].scale[k], 0);                       \
          scales[1][i] = (int16_t)_mm256_extract_epi16(u[i].scale[k], 8);                       \
        }                                                                                       \
        __m512i t[8];                                                                           \
        transpose_rows(q, t);                                                                   \
        for (int j = 0; j < 8; ++j) _mm512_store_si512(out[b].q[8 * k + j], t[j]);              \
        for (int h = 0; h < 32 / sub; ++h) {                                                    \
          const __m512i scale = _mm512_loadu_si512(scales[h]);                                  \
          _mm512_store_si512(out[b].scale[k * 32 / sub + h], scale);                            \
          offset = _mm512_add_epi32(offset, _mm512_mullo_epi32(                                 \
              scale, lane_sums(t, h * sub / 4, (h + 1) * sub / 4)));                            \
        }                                                                                       \
      }                                                                                         \
      _mm512_store_si512(out[b].offset, times_minus_128(offset));                               \
    }                                                                                           \
  }
DEFINE_STRIPK(q4_k, BlockQ4_K)
DEFINE_STRIPK(q5_k, BlockQ5_K)
DEFINE_STRIPK(q6_k, BlockQ6_K)

static inline __m512i bcast4(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* The activations a strip product reads: xs [rows, in] bytes, x + 128, and each row's block
   scales and sums where ActQ8 / ActQ8K keep them. */
typedef struct {
  const uint8_t *xs;
  int64_t in;
  const uint8_t *xq; /* ActQ8 or ActQ8K rows */
  int64_t xq_row_bytes;
} StripActs;

/* Strip x nr (<= NR_MAX) activation rows with the activations broadcast (VNNI). */
static void strip32_vnni(const Strip32 *s, int nw, const StripActs *x, int64_t r0, int nr,
                         int64_t blocks, int has_min, float *y, int64_t ldy) {
  __m512 acc[NR_MAX], accm[NR_MAX];
  for (int r = 0; r < NR_MAX; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i q[QK / 4];
    for (int t = 0; t < QK / 4; ++t) q[t] = _mm512_load_si512(s[b].q[t]);
    const __m512i offset = _mm512_load_si512(s[b].offset);
    const __m512 dv = _mm512_load_ps(s[b].d), mv = _mm512_load_ps(s[b].m);
    for (int r = 0; r < NR_MAX; ++r) {
      if (r >= nr) break;
      const uint8_t *xs = x->xs + (r0 + r) * x->in + b * QK;
      __m512i sum = offset;
      for (int t = 0; t < QK / 4; ++t) sum = _mm512_dpbusd_epi32(sum, bcast4(xs + 4 * t), q[t]);
      const ActQ8 *xb = (const ActQ8 *)(x->xq + (r0 + r) * x->xq_row_bytes) + b;
      const __m512 dx = _mm512_set1_ps(xb->d);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dx), _mm512_cvtepi32_ps(sum), acc[r]);
      if (has_min)
        accm[r] = _mm512_fmadd_ps(_mm512_mul_ps(mv, dx), _mm512_set1_ps((float)xb->sum), accm[r]);
    }
  }
  for (int r = 0; r < nr && r < NR_MAX; ++r)
    _mm512_mask_storeu_ps(y + r * ldy, first_lanes(nw), _mm512_add_ps(acc[r], accm[r]));
}

/* The min term of a k-quant super-block for one activation row: sum_j bsums_j * min_j. */
static inline __m512i k_mins(const StripK *s, const ActQ8K *xb) {
  __m512i m = _mm512_setzero_si512();
  for (int p = 0; p < QKK / 32; ++p) m = _mm512_dpwssd_epi32(m, bcast4((const uint8_t *)(xb->bsums + 2 * p)),
                                                             _mm512_load_si512(s->min[p]));
  return m;
}

static void stripk_vnni(const StripK *s, int nw, const StripActs *x, int64_t r0, int nr,
                        int64_t blocks, int sub, float *y, int64_t ldy) {
  __m512 acc[NR_MAX], accm[NR_MAX];
  for (int r = 0; r < NR_MAX; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 dv = _mm512_load_ps(s[b].d), dminv = _mm512_load_ps(s[b].dmin);
    for (int r = 0; r < NR_MAX; ++r) {
      if (r >= nr) break;
      const uint8_t *xs = x->xs + (r0 + r) * x->in + b * QKK;
      __m512i total = _mm512_load_si512(s[b].offset);
      for (int sb = 0; sb < QKK / sub; ++sb) {
        __m512i dot = _mm512_setzero_si512();
        for (int t = sb * sub / 4; t < (sb + 1) * sub / 4; ++t)
          dot = _mm512_dpbusd_epi32(dot, bcast4(xs + 4 * t), _mm512_load_si512(s[b].q[t]));
        total = _mm512_add_epi32(total, _mm512_mullo_epi32(dot, _mm512_load_si512(s[b].scale[sb])));
      }
      const ActQ8K *xb = (const ActQ8K *)(x->xq + (r0 + r) * x->xq_row_bytes) + b;
      const __m512 dx = _mm512_set1_ps(xb->d);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dx), _mm512_cvtepi32_ps(total), acc[r]);
      accm[r] = _mm512_fmadd_ps(_mm512_mul_ps(dminv, dx), _mm512_cvtepi32_ps(k_mins(&s[b], xb)), accm[r]);
    }
  }
  for (int r = 0; r < nr && r < NR_MAX; ++r)
    _mm512_mask_storeu_ps(y + r * ldy, first_lanes(nw), _mm512_sub_ps(acc[r], accm[r]));
}

/* ---- AMX ---------------------------------------------------------------------------------- */

#define AMX_ROWS 16 /* activation rows of a tile */
/* AMX only for k-quants and a full tile of rows or more: a 32-value type's float scale every
   block leaves the tile unit after every TDPBUSD, and VNNI strips measured faster there at any
   row count (the default model's Q8_0 head: 85 against 106 ms at 128 rows); k-quants gain from
   about 16 rows (benchmarks/results/gguf-in-place/xeon/strips-amx-2026-12-05.md). */
#define AMX_MIN_ROWS 16
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* Two sets (0-2 and 3-5) of: activations (16 x `sub` bytes), weights (sub / 4 x 64 bytes) and
   their 16 x 16 int32 products, so that one block's tile work runs while the vector unit
   finishes the block before (one set made each block wait for the last one's epilogue). */
AMX_TARGET static void amx_configure(int sub) {
  TileConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int set = 0; set < 6; set += 3) {
    c.rows[set] = AMX_ROWS;
    c.colsb[set] = (uint16_t)sub;
    c.rows[set + 1] = (uint8_t)(sub / 4);
    c.colsb[set + 1] = 64;
    c.rows[set + 2] = AMX_ROWS;
    c.colsb[set + 2] = 64;
  }
  /* GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without the barrier the stores
     to the rest of the 64 may be dropped (a SIGILL at the first tile load). */
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

AMX_TARGET static void amx_release(void) { _tile_release(); }

/* Strip x 16 activation rows from r0 (the activations are padded to a multiple of 16 rows);
   rows r0 + nr and on are not written. */
AMX_TARGET static void strip32_amx(const Strip32 *s, int nw, const StripActs *x, int64_t r0,
                                   int nr, int64_t blocks, int has_min, float *y, int64_t ldy) {
  __m512 acc[AMX_ROWS];
  int32_t c[2][AMX_ROWS][GROUP] __attribute__((aligned(64)));
  for (int r = 0; r < AMX_ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t *xs = x->xs + r0 * x->in;
/* Tile numbers are spelled into the instructions: one macro per set. */
#define PRODUCT32(A, B, C, b)                                                                   \
  do {                                                                                          \
    _tile_loadd(A, xs + (b) * QK, x->in);                                                       \
    _tile_loadd(B, s[b].q, 64);                                                                 \
    _tile_zero(C);                                                                              \
    _tile_dpbusd(C, A, B);                                                                      \
    _tile_stored(C, c[(b) & 1], 64);                                                            \
  } while (0)
  PRODUCT32(0, 1, 2, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) { /* the next block's tiles, while this one's integers are scaled */
      if (b & 1) PRODUCT32(0, 1, 2, b + 1);
      else PRODUCT32(3, 4, 5, b + 1);
    }
    const __m512i offset = _mm512_load_si512(s[b].offset);
    const __m512 dv = _mm512_load_ps(s[b].d);
    for (int r = 0; r < AMX_ROWS; ++r) {
      if (r >= nr) break; /* the activation rows stop at m: the tile's padding has no scale */
      const ActQ8 *xb = (const ActQ8 *)(x->xq + (r0 + r) * x->xq_row_bytes) + b;
      const __m512i sum = _mm512_add_epi32(_mm512_load_si512(c[b & 1][r]), offset);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(sum), acc[r]);
    }
  }
#undef PRODUCT32
  for (int r = 0; r < nr; ++r) {
    __m512 accm = _mm512_setzero_ps();
    if (has_min)
      for (int64_t b = 0; b < blocks; ++b) {
        const ActQ8 *xb = (const ActQ8 *)(x->xq + (r0 + r) * x->xq_row_bytes) + b;
        accm = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(s[b].m), _mm512_set1_ps(xb->d)),
                               _mm512_set1_ps((float)xb->sum), accm);
      }
    _mm512_mask_storeu_ps(y + r * ldy, first_lanes(nw), _mm512_add_ps(acc[r], accm));
  }
}

AMX_TARGET static void stripk_amx(const StripK *s, int nw, const StripActs *x, int64_t r0,
                                  int nr, int64_t blocks, int sub, float *y, int64_t ldy) {
  float acc[AMX_ROWS][GROUP] __attribute__((aligned(64)));
  int32_t c[2][AMX_ROWS][GROUP] __attribute__((aligned(64)));
  memset(acc, 0, sizeof acc);
  const uint8_t *xs = x->xs + r0 * x->in;
  const int subs = QKK / sub; /* products of a super-block, step i = b * subs + sb */
#define PRODUCTK(A, B, C, i)                                                                    \
  do {                                                                                          \
    _tile_loadd(A, xs + (i) / subs * QKK + (i) % subs * sub, x->in);                            \
    _tile_loadd(B, s[(i) / subs].q[(i) % subs * sub / 4], 64);                                  \
    _tile_zero(C);                                                                              \
    _tile_dpbusd(C, A, B);                                                                      \
    _tile_stored(C, c[(i) & 1], 64);                                                            \
  } while (0)
  PRODUCTK(0, 1, 2, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i total[AMX_ROWS];
    const __m512i offset = _mm512_load_si512(s[b].offset);
    for (int r = 0; r < AMX_ROWS; ++r) total[r] = offset;
    for (int sb = 0; sb < subs; ++sb) {
      const int64_t i = b * subs + sb;
      if (i + 1 < blocks * subs) { /* the next product's tiles while this one is scaled */
        if (i & 1) PRODUCTK(0, 1, 2, i + 1);
        else PRODUCTK(3, 4, 5, i + 1);
      }
      const __m512i scale = _mm512_load_si512(s[b].scale[sb]);
      for (int r = 0; r < AMX_ROWS; ++r) {
        if (r >= nr) break;
        total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(_mm512_load_si512(c[i & 1][r]), scale));
      }
    }
    const __m512 dv = _mm512_load_ps(s[b].d);
    for (int r = 0; r < AMX_ROWS; ++r) {
      if (r >= nr) break;
      const ActQ8K *xb = (const ActQ8K *)(x->xq + (r0 + r) * x->xq_row_bytes) + b;
      _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(xb->d)),
                                              _mm512_cvtepi32_ps(total[r]), _mm512_load_ps(acc[r])));
    }
  }
  for (int r = 0; r < nr; ++r) {
    __m512 accm = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const ActQ8K *xb = (const ActQ8K *)(x->xq + (r0 + r) * x->xq_row_bytes) + b;
      accm = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(s[b].dmin), _mm512_set1_ps(xb->d)),
                             _mm512_cvtepi32_ps(k_mins(&s[b], xb)), accm);
    }
    _mm512_mask_storeu_ps(y + r * ldy, first_lanes(nw), _mm512_sub_ps(_mm512_load_ps(acc[r]), accm));
  }
#undef PRODUCTK
}

/* AMX is used once the process has the kernel's permission for tile data (Linux asks each
   process to request it) and quant_amx(1) was called; quant_amx(0) turns it off (tests, and
   REWIND_NO_AMX=1). */
#include <cpuid.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_permitted = -1; /* unknown until first asked */
static _Atomic int amx_on = 0;

static int amx_supported(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  if (!(d & (1u << 24)) || !(d & (1u << 25))) return 0; /* AMX-TILE, AMX-INT8 */
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return 0; /* XTILECFG and XTILEDATA enabled */
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int quant_amx(int want) {
  if (want < 0) return atomic_load(&amx_on);
  if (want && amx_permitted < 0) amx_permitted = amx_supported();
  atomic_store(&amx_on, want && amx_permitted > 0);
  return atomic_load(&amx_on);
}
#else
int quant_amx(int want) { (void)want; return 0; }
#endif /* __AVX512VNNI__ */

/* ---- the claim: 32 weight rows of one part against every activation row ------------------ */

#ifdef __AVX512VNNI__
/* This thread's strips, grown to the largest claim (as claim_strip's Pre32 rows). */
static _Thread_local void *strip512;
static _Thread_local size_t strip512_bytes;

static void *claim_strip512(size_t bytes) {
  if (bytes > strip512_bytes) {
    void *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!grown) return NULL;
    free(strip512);
    strip512 = grown;
    strip512_bytes = bytes;
  }
  return strip512;
}
#endif

#ifdef __AVX512VNNI__
/* Where AMX tiles beat VNNI strips for a product of m activation rows (quant.c's amx_rule 0;
   1: AMX wherever it is on, 2: never, for measuring). */
static inline int amx_pays(int k_quant, int64_t m) {
  const int rule = atomic_load(&amx_rule);
  if (rule) return rule == 1;
  return k_quant && m >= AMX_MIN_ROWS;
}
#endif

static void qmatvec_block(const void *arg, int64_t claim) {
  const QJob *j = (const QJob *)arg;
  int64_t start, end;
  const QJobPart *part = claim_rows(j, claim, &start, &end);
  float *y = j->y + part->first + start;
#ifdef __AVX512VNNI__
  if (j->strips && j->m > NR_MAX) {
    const uint8_t *W = part->W + start * part->row_bytes;
    const int k = is_k_quant(part->type), groups = (int)((end - start + GROUP - 1) / GROUP);
    const size_t per_group = (size_t)part->blocks * (k ? sizeof(StripK) : sizeof(Strip32));
    uint8_t *strip = claim_strip512(groups * per_group);
    if (strip) {
      const StripActs acts = {k ? j->xsk : j->xs, j->in, part->xq, part->xq_row_bytes};
      const int sub = sub_values(part->type), has_min = part->type == GGML_Q4_1 || part->type == GGML_Q5_1;
      const int amx = atomic_load(&amx_on) && amx_pays(k, j->m);
      for (int g = 0; g < groups; ++g) {
        const int nw = (int)(end - start - g * GROUP < GROUP ? end - start - g * GROUP : GROUP);
        void *s = strip + g * per_group;
        const uint8_t *w = W + g * GROUP * part->row_bytes;
        switch (part->type) {
          case GGML_Q8_0: strip_q8_0(w, part->row_bytes, nw, part->blocks, s); break;
          case GGML_Q4_0: strip_q4_0(w, part->row_bytes, nw, part->blocks, s); break;
          case GGML_Q5_0: strip_q5_0(w, part->row_bytes, nw, part->blocks, s); break;
          case GGML_Q4_1: strip_q4_1(w, part->row_bytes, nw, part->blocks, s); break;
          case GGML_Q5_1: strip_q5_1(w, part->row_bytes, nw, part->blocks, s); break;
          case GGML_Q4_K: strip_q4_k(w, part->row_bytes, nw, part->blocks, s, sub); break;
          case GGML_Q5_K: strip_q5_k(w, part->row_bytes, nw, part->blocks, s, sub); break;
          case GGML_Q6_K: strip_q6_k(w, part->row_bytes, nw, part->blocks, s, sub); break;
        }
      }
      if (amx) amx_configure(k ? sub : QK);
      const int step = amx ? AMX_ROWS : NR_MAX;
      for (int64_t r0 = 0; r0 < j->m; r0 += step) {
        const int nr = (int)(j->m - r0 < step ? j->m - r0 : step);
        for (int g = 0; g < groups; ++g) {
          const int nw = (int)(end - start - g * GROUP < GROUP ? end - start - g * GROUP : GROUP);
          const void *s = strip + g * per_group;
          float *out = y + r0 * j->ldy + g * GROUP;
          if (amx && k) stripk_amx(s, nw, &acts, r0, nr, part->blocks, sub, out, j->ldy);
          else if (amx) strip32_amx(s, nw, &acts, r0, nr, part->blocks, has_min, out, j->ldy);
          else if (k) stripk_vnni(s, nw, &acts, r0, nr, part->blocks, sub, out, j->ldy);
          else strip32_vnni(s, nw, &acts, r0, nr, part->blocks, has_min, out, j->ldy);
        }
      }
      if (amx) amx_release();
      return;
    }
  }
#endif
  /* Stored blocks; with more than one pass of activation rows, the 32-value types' rows are
     unpacked once into Pre32 first (the same bytes and scales, so the same bits). */
  int64_t wstride;
  int unpacked;
  const uint8_t *rows = claim_weights(part, j->m, start, end, &wstride, &unpacked);
  const GroupFn group = group_for(part->type, unpacked);
  for (int64_t r0 = 0; r0 < j->m; r0 += NR_MAX) {
    const int nr = (int)(j->m - r0 < NR_MAX ? j->m - r0 : NR_MAX);
    for (int64_t o = start; o < end; o += GROUP) {
      const int nw = (int)(end - o < GROUP ? end - o : GROUP);
      group(rows + (o - start) * wstride, wstride, nw, part->xq + r0 * part->xq_row_bytes,
            part->xq_row_bytes, nr, part->blocks, y + r0 * j->ldy + (o - start), j->ldy);
    }
  }
}
