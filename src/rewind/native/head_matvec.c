/* Output-projection matvec for CPU decode: logits[m][v] = sum_k x[m][k] * W[v][k].

   W is stored as bfloat16 (half the bytes of float32, exact for bf16 checkpoints) or as int8
   with one float32 scale per row. Decode on a CPU is bound by memory bandwidth, and MLX's CPU
   backend has no fast kernel for either form (its bf16 and quantized matmuls run slower than
   float32 through BLAS), so this reads each weight once, widens it to float32 in registers and
   accumulates in float32 with FMA. Rows are split across threads. Built at first use by
   rewind.engine.fast_head with the system C compiler; without one, Rewind uses MLX's matmul. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 8
#define MAX_THREADS 64

typedef struct {
  const void *weight; const float *row_scale; const float *x; float *out;
  int64_t vocab, dim, m, begin, end; int is_int8;
} Job;

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

static void run_rows(const Job *job) {
  const int64_t dim = job->dim, m = job->m;
  for (int64_t v = job->begin; v < job->end; ++v) {
    __m256 acc[MAX_ROWS];
    for (int64_t r = 0; r < m; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= dim; k += 8) {
      __m256 w;
      if (job->is_int8) {
        const int8_t *row = (const int8_t *)job->weight + v * dim;
        w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k))));
      } else {
        const uint16_t *row = (const uint16_t *)job->weight + v * dim;
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + k)));
        w = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
      }
      for (int64_t r = 0; r < m; ++r)
        acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(job->x + r * dim + k), acc[r]);
    }
    for (int64_t r = 0; r < m; ++r) {
      float sum = hsum(acc[r]);
      for (int64_t j = k; j < dim; ++j) {
        float w;
        if (job->is_int8) {
          w = (float)((const int8_t *)job->weight)[v * dim + j];
        } else {
          uint32_t bits = (uint32_t)((const uint16_t *)job->weight)[v * dim + j] << 16;
          memcpy(&w, &bits, sizeof w);
        }
        sum += w * job->x[r * dim + j];
      }
      if (job->is_int8) sum *= job->row_scale[v];
      job->out[r * job->vocab + v] = sum;
    }
  }
}

static void *thread_main(void *arg) { run_rows((const Job *)arg); return NULL; }

/* x: [m, dim] float32, out: [m, vocab] float32; m <= MAX_ROWS (callers split larger batches). */
int head_matvec(const void *weight, const float *row_scale, int is_int8, const float *x,
                float *out, int64_t vocab, int64_t dim, int64_t m, int threads) {
  if (m < 1 || m > MAX_ROWS) return -1;
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  Job jobs[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int64_t per = (vocab + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    int64_t begin = t * per, end = begin + per < vocab ? begin + per : vocab;
    jobs[t] = (Job){weight, row_scale, x, out, vocab, dim, m, begin, end, is_int8};
  }
  int started = 0;
  for (int t = 1; t < threads; ++t) {
    if (pthread_create(&ids[t], NULL, thread_main, &jobs[t]) != 0) break;
    started = t;
  }
  run_rows(&jobs[0]);
  for (int t = started + 1; t < threads; ++t) run_rows(&jobs[t]); /* threads that failed to start */
  for (int t = 1; t <= started; ++t) pthread_join(ids[t], NULL);
  return 0;
}
