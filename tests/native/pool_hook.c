/* The pauses tests/test_native_pool.py builds into a copy of the kernels (-DPOOL_TESTING): 20 us
   on some passes through each exposed point of the pool's claim protocol, as a busy machine's
   scheduler gives now and then. */
#include <stdatomic.h>
#include <time.h>

void pool_test_hook(int where) {
  static _Atomic unsigned calls = 0;
  unsigned k = atomic_fetch_add(&calls, 1);
  if (k % (where == 0 ? 7 : 3) == 0) {
    struct timespec pause = {0, 20000};
    nanosleep(&pause, NULL);
  }
}
