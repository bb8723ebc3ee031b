/* Stress for the kernels' thread pool (src/rewind/kernels/c/pool.c): many small jobs of two
   kinds, whose argument structs differ as a matvec's and a row task's do, each run through
   run_blocks. Every block must run exactly once, with its own job's function and arguments,
   before run_blocks returns. Built by tests/test_native_pool.py with pool_hook.c and -DPOOL_TESTING,
   pausing each side of the claim protocol where a race would show, and under ThreadSanitizer.

   usage: pool_stress JOBS THREADS   (exit 0 and "violations 0" when the pool held) */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "simd.h"

enum { TAG_A = 0x41414141, TAG_B = 0x42424242, MAX_BLOCKS = 8 };
typedef struct {
  int tag;
  int64_t blocks;
  _Atomic int runs[MAX_BLOCKS];
  _Atomic int open; /* 1 while run_blocks runs this job */
} Job;

static _Atomic long wrong_job = 0, after_return = 0;

static void run_block(const Job *job, int tag, int64_t block) {
  if (job->tag != tag || block >= job->blocks) { atomic_fetch_add(&wrong_job, 1); return; }
  if (!atomic_load((_Atomic int *)&job->open)) atomic_fetch_add(&after_return, 1);
  atomic_fetch_add((_Atomic int *)&job->runs[block], 1);
}
static void fn_a(const void *args, int64_t block) { run_block(args, TAG_A, block); }
static void fn_b(const void *args, int64_t block) { run_block(args, TAG_B, block); }

int main(int argc, char **argv) {
  if (argc != 3) { fprintf(stderr, "usage: %s JOBS THREADS\n", argv[0]); return 2; }
  long jobs = atol(argv[1]);
  int threads = atoi(argv[2]);
  long miscounted = 0;
  for (long i = 0; i < jobs; ++i) {
    Job job = {.tag = i % 2 ? TAG_A : TAG_B, .blocks = 1 + i % 5};
    for (int b = 0; b < MAX_BLOCKS; ++b) atomic_store(&job.runs[b], 0);
    atomic_store(&job.open, 1);
    run_blocks(i % 2 ? fn_a : fn_b, &job, job.blocks, threads);
    atomic_store(&job.open, 0);
    for (int b = 0; b < job.blocks; ++b)
      if (atomic_load(&job.runs[b]) != 1) { ++miscounted; break; }
  }
  long violations = miscounted + atomic_load(&wrong_job) + atomic_load(&after_return);
  printf("jobs %ld, threads %d: %ld with a block not run exactly once, %ld blocks run with "
         "another job's arguments, %ld run after their job returned; violations %ld\n",
         jobs, threads, miscounted, atomic_load(&wrong_job), atomic_load(&after_return),
         violations);
  return violations != 0;
}
