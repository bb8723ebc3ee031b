/* The GGUF block product alone, outside Python: one matrix of random blocks, timed over 20
   calls after 3 warm-ups. What the prefetch numbers of issue 25 came from.

   Build and run from the repository root (flags as native.compile_flags("avx512vnni")):
     gcc -O3 -pthread -ffp-contract=off -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl \
         -mavx512dq -mavx512vnni -Isrc/rewind/kernels/c scripts/native/quant_matvec_bench.c \
         src/rewind/kernels/c/quant.c src/rewind/kernels/c/pool.c -o /tmp/quant_matvec_bench -lm
     /tmp/quant_matvec_bench TYPE ROWS IN THREADS M
   TYPE is ggml's type id (8 Q8_0, 12 Q4_K, 14 Q6_K, 6 Q5_0, 2 Q4_0); the default model's head is
   8 262144 640. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#include "quant.h"
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
  int type = argc > 1 ? atoi(argv[1]) : 8; /* ggml type id */
  int64_t rows = argc > 2 ? atoll(argv[2]) : 262144, in = argc > 3 ? atoll(argv[3]) : 640;
  int threads = argc > 4 ? atoi(argv[4]) : 1, m = argc > 5 ? atoi(argv[5]) : 1;
  int64_t bpr = in / ggml_block_elements(type) * ggml_block_bytes(type);
  uint8_t *W = aligned_alloc(64, (rows * bpr + 63) / 64 * 64);
  srand(1);
  for (int64_t i = 0; i < rows * bpr; ++i) W[i] = rand();
  /* keep fp16 scales sane: every block's first 2 bytes = 0x3c00-ish for Q8_0 */
  if (type == 8) for (int64_t i = 0; i < rows * bpr; i += 34) { W[i] = 0; W[i + 1] = 0x20; }
  float *x = malloc(m * in * 4), *y = malloc(m * rows * 4);
  for (int64_t i = 0; i < m * in; ++i) x[i] = (float)rand() / RAND_MAX - 0.5f;
  if (getenv("AMX")) printf("amx %d\n", quant_amx(atoi(getenv("AMX"))));
  QPart part = {W, type, 0, rows};
  for (int i = 0; i < 3; ++i) qmatvec_parts(&part, 1, x, y, rows, in, m, threads);
  int N = 20; double t = now();
  for (int i = 0; i < N; ++i) qmatvec_parts(&part, 1, x, y, rows, in, m, threads);
  double dt = (now() - t) / N;
  printf("type %d rows %ld in %ld m %d threads %d: %.3f ms, %.1f GB/s, y0 %g\n", type, rows, in, m, threads, dt * 1e3, rows * bpr / dt / 1e9, y[0]);
}
