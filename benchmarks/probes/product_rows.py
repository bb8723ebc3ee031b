"""A GGUF-form matrix product on the CPU kernels by the number of activation rows: what one more
row costs (a drafted token's check adds one), at the shape of the default model's 262k x 640
Q8_0 output head unless told otherwise. Random blocks with small scales; median of 7 calls.

    python benchmarks/probes/product_rows.py                      # the head, 1-9, 12, 16, 17, 32
    python benchmarks/probes/product_rows.py --rows 2048 --cols 640 --type Q5_0 --m 1 4 5 32
    python benchmarks/probes/product_rows.py --threads 1 --issue-rate  # AVX2's ceiling beside

--issue-rate also builds (with the system C compiler) and times the AVX2 build's instructions for
one 32-value block of a weight row and an activation row, with nothing to load: eight
independent chains of `vpmaddubsw` + `vpmaddwd` alone, then with the int-to-float conversion and
the fma, then with the Q8_0 sign fix and the scales' product (the head's tile). Products a
second for the product at each m are printed beside it: the kernel's share of that ceiling.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from rewind.kernels import boundary, native


# The instructions of one block's product as the AVX2 tiles issue them, in eight independent
# chains (as a 2 x 4 tile has eight accumulators); the operand changes each time so that no
# result can be reused. Prints products per second (32 per block) for each mix.
_ISSUE_RATE_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
#define ROUNDS 25000000L
/* BODY(i) is one block of chain i; a and dx change every block */
#define TIME(SECONDS, BODY)                                                   \
  do {                                                                        \
    double t = now();                                                         \
    for (long n = 0; n < ROUNDS; n++) {                                       \
      for (int i = 0; i < 8; i++) { BODY; }                                   \
      a = _mm256_add_epi8(a, ones);                                           \
      dx = _mm256_add_ps(dx, step);                                           \
    }                                                                         \
    SECONDS = now() - t;                                                      \
  } while (0)
int main(void) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
  __m256 dx = _mm256_set1_ps(0.5f), dw = _mm256_set1_ps(0.25f), step = _mm256_set1_ps(1e-9f);
  __m256i acc[8];
  __m256 facc[8];
  for (int i = 0; i < 8; i++) { acc[i] = _mm256_setzero_si256(); facc[i] = _mm256_setzero_ps(); }
  double took[3];
  TIME(took[0], acc[i] = _mm256_add_epi32(acc[i],
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_add_epi8(a, acc[i]), b), ones)));
  TIME(took[1], facc[i] = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(_mm256_madd_epi16(
      _mm256_maddubs_epi16(_mm256_add_epi8(a, acc[i]), b), ones)), facc[i]));
  TIME(took[2], facc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(
      _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(b, _mm256_add_epi8(a, acc[i]))),
                        ones)), facc[i]));
  int keep = 0;
  for (int i = 0; i < 8; i++) keep += _mm256_extract_epi32(acc[i], 0) + (int)facc[i][0];
  const double products = 8.0 * ROUNDS * 32;
  printf("%.2f %.2f %.2f %d\\n", products / took[0] / 1e9, products / took[1] / 1e9,
         products / took[2] / 1e9, keep & 1);
  return 0;
}
"""


def issue_rate() -> tuple[float, float, float]:
    """Billions of products a second on one core for the three instruction mixes."""
    compiler = native.c_compiler()
    if compiler is None:
        raise SystemExit("--issue-rate needs a C compiler")
    with tempfile.TemporaryDirectory() as scratch:
        source, binary = Path(scratch) / "rate.c", Path(scratch) / "rate"
        source.write_text(_ISSUE_RATE_C)
        subprocess.run([compiler, "-O2", "-mavx2", "-mfma", "-o", str(binary), str(source)],
                       check=True)
        fields = subprocess.run([str(binary)], check=True, capture_output=True,
                                text=True).stdout.split()
    return float(fields[0]), float(fields[1]), float(fields[2])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/product_rows.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=262144, help="output rows (weight rows)")
    parser.add_argument("--cols", type=int, default=640)
    parser.add_argument("--type", default="Q8_0", choices=sorted(native.GGML_TYPES))
    parser.add_argument("--m", type=int, nargs="+",
                        default=[1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 32])
    parser.add_argument("--threads", type=int, default=native.kernel_threads())
    parser.add_argument("--issue-rate", action="store_true",
                        help="also time AVX2's block instructions with nothing to load")
    args = parser.parse_args()
    kernels = boundary.kernels()
    if kernels is None:
        raise SystemExit("no CPU kernels on this machine")
    ggml_type = native.GGML_TYPES[args.type]
    values, nbytes = native.GGML_BLOCKS[ggml_type]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(args.rows, args.cols // values, nbytes), dtype=np.uint8)
    # every block's leading fp16 scale (and a k-quant's super-block scale) a small number
    blocks[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    matrix = boundary.MatrixArgs.build(blocks.reshape(args.rows, -1),
                                       native.FORM_GGML + ggml_type, cols=args.cols)
    print(f"{args.type} {args.rows} x {args.cols}, {args.threads} threads, "
          f"kernels {native.kernels_summary()}")
    if args.issue_rate:
        alone, converted, head = issue_rate()
        print(f"one core, no loads, billions of products a second: vpmaddubsw + vpmaddwd "
              f"{alone:.1f}; + conversion and fma {converted:.1f}; + Q8_0's sign fix and the "
              f"scales' product (the head's tile) {head:.1f}")
    for m in args.m:
        x = rng.standard_normal((m, args.cols)).astype(np.float32)
        out = np.empty((m, args.rows), np.float32)
        kernels.matvec(matrix, x, out, args.threads)
        times = []
        for _ in range(7):
            started = time.perf_counter()
            kernels.matvec(matrix, x, out, args.threads)
            times.append(time.perf_counter() - started)
        ms = 1e3 * sorted(times)[len(times) // 2]
        rate = m * args.rows * args.cols / (ms * 1e-3) / 1e9 / args.threads
        print(f"m={m:3d}: {ms:8.2f} ms, {ms / m:6.2f} ms a row, "
              f"{rate:5.1f} billion products a second a thread")


if __name__ == "__main__":
    main()
