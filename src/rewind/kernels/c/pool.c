/* The kernels' thread pool: run_blocks(fn, args, blocks, threads) calls fn(args, b) for every b
   in [0, blocks) exactly once, over the calling thread and up to threads - 1 workers, and
   returns only when every call has returned.

   Why not OpenMP: a job here is a list of blocks that threads claim from one atomic counter,
   and a job is done when its blocks are done, not when every thread has checked in. On a busy
   machine (a benchmark, another server) a descheduled worker then costs nothing, where an
   OpenMP barrier waits a whole time slice for it at every matvec (measured: decode fell from 27
   to 2 tokens/s with one other busy process on 2 cores).

   The claim word is generation << 32 | next block. A worker reads it, then the job (fn, args,
   blocks), then claims a block with a compare-and-swap on the word it read. The job is written
   only while the word is closed: before writing a new job the caller swaps in
   (old generation, CLOSED), so a worker that read the old generation's word can no longer
   claim with it, whatever job fields it read. Without the close a worker that read the finished
   job's word (block == its block count), then the next job's fields, could claim "block n" of
   the finished job and run the next job's function on it before the next job opened: that
   block then ran twice, the second job's done count ran ahead, and its caller returned while
   a worker still read its stack (the SIGSEGVs of issue 23; tests/test_native_pool.py). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "simd.h"

/* Fault injection for tests/test_native_pool.py (built with -DPOOL_TESTING): a pause where each
   side of the claim protocol is most exposed. Empty in the kernels. */
#ifdef POOL_TESTING
void pool_test_hook(int where);
#define POOL_TEST_HOOK(where) pool_test_hook(where)
#else
#define POOL_TEST_HOOK(where) ((void)0)
#endif
enum { HOOK_WORKER_READ_CLAIM = 0, HOOK_CALLER_WROTE_JOB = 1 };

#define MAX_WORKERS 63
#define SPIN_ROUNDS 20000 /* ~0.1-0.3 ms of pause before a worker sleeps */
#define CLOSED 0xffffffffu  /* the block index of a closed claim word: never below a count */

static struct {
  _Atomic uint64_t claim; /* generation << 32 | next block to claim, or CLOSED */
  _Atomic int64_t done;   /* blocks finished in this generation */
  /* The job: written by the caller only while the claim word is closed. Atomic (relaxed) so a
     worker that reads them mid-write reads some value; its claim then fails. */
  _Atomic(BlockFn) fn;
  _Atomic(const void *) args;
  _Atomic int64_t blocks;
  uint32_t generation; /* the caller's own count, under run_lock */
  int workers;         /* under run_lock */
  int sleepers;        /* under lock */
  pthread_mutex_t lock;
  pthread_cond_t wake;
  pthread_mutex_t run_lock; /* one job at a time */
} pool = {.claim = (uint64_t)CLOSED, .lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .run_lock = PTHREAD_MUTEX_INITIALIZER};

static inline uint32_t gen_of(uint64_t claim) { return (uint32_t)(claim >> 32); }

/* Claim and run blocks of generation `gen` until none is left. A claim succeeds only while the
   word still holds what was read before the job, and the job is rewritten only after the word
   was closed, so the job a successful claim runs is the one of its generation. */
static void work(uint32_t gen) {
  for (;;) {
    uint64_t claim = atomic_load_explicit(&pool.claim, memory_order_acquire);
    if (gen_of(claim) != gen) return;
    POOL_TEST_HOOK(HOOK_WORKER_READ_CLAIM);
    BlockFn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
    const void *args = atomic_load_explicit(&pool.args, memory_order_relaxed);
    int64_t blocks = atomic_load_explicit(&pool.blocks, memory_order_relaxed);
    int64_t block = (int64_t)(uint32_t)claim;
    if (block >= blocks) return;
    if (!atomic_compare_exchange_weak_explicit(&pool.claim, &claim, claim + 1,
                                               memory_order_acq_rel, memory_order_acquire))
      continue;
    fn(args, block);
    atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
  }
}

static void *worker_main(void *unused) {
  (void)unused;
  uint32_t seen = 0;
  for (;;) {
    uint64_t claim;
    int spins = 0;
    while (gen_of(claim = atomic_load_explicit(&pool.claim, memory_order_acquire)) == seen) {
      if (++spins < SPIN_ROUNDS) {
        _mm_pause();
        continue;
      }
      pthread_mutex_lock(&pool.lock);
      pool.sleepers++;
      while (gen_of(atomic_load_explicit(&pool.claim, memory_order_acquire)) == seen)
        pthread_cond_wait(&pool.wake, &pool.lock);
      pool.sleepers--;
      pthread_mutex_unlock(&pool.lock);
      spins = 0;
    }
    seen = gen_of(claim);
    work(seen);
  }
  return NULL;
}

static void ensure_workers(int wanted) {
  if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
  while (pool.workers < wanted) {
    pthread_t id;
    if (pthread_create(&id, NULL, worker_main, NULL) != 0) return; /* fewer threads, still correct */
    pthread_detach(id);
    pool.workers++;
  }
}

void run_blocks(BlockFn fn, const void *args, int64_t blocks, int threads) {
  if (threads <= 1 || blocks <= 1) {
    for (int64_t b = 0; b < blocks; ++b) fn(args, b);
    return;
  }
  pthread_mutex_lock(&pool.run_lock);
  ensure_workers(threads - 1);
  /* Close the last generation's word before touching the job (acq_rel: the writes below stay
     after it, and a worker's successful claim on the old word happened before it). */
  atomic_exchange_explicit(&pool.claim, (uint64_t)pool.generation << 32 | CLOSED,
                           memory_order_acq_rel);
  atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
  atomic_store_explicit(&pool.args, args, memory_order_relaxed);
  atomic_store_explicit(&pool.blocks, blocks, memory_order_relaxed);
  atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
  POOL_TEST_HOOK(HOOK_CALLER_WROTE_JOB);
  uint32_t gen = ++pool.generation;
  atomic_store_explicit(&pool.claim, (uint64_t)gen << 32, memory_order_release);
  pthread_mutex_lock(&pool.lock);
  if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.lock);
  work(gen);
  /* Only blocks already claimed by a worker are left: wait for those, yielding now and then
     in case that worker shares this core. */
  for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < blocks; ++spins) {
    if (spins % 64 == 63) sched_yield(); else _mm_pause();
  }
  pthread_mutex_unlock(&pool.run_lock);
}
