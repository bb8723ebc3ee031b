"""A GGUF-form matrix product on the CPU kernels by the number of activation rows: what one more
row costs (a drafted token's check adds one), at the shape of the default model's 262k x 640
Q8_0 output head unless told otherwise. Random blocks with small scales; median of 7 calls.

    python benchmarks/probes/product_rows.py                      # the head, 1-9, 12, 16, 17, 32
    python benchmarks/probes/product_rows.py --rows 2048 --cols 640 --type Q5_0 --m 1 4 5 32
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rewind.kernels import boundary, native


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/product_rows.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=262144, help="output rows (weight rows)")
    parser.add_argument("--cols", type=int, default=640)
    parser.add_argument("--type", default="Q8_0", choices=sorted(native.GGML_TYPES))
    parser.add_argument("--m", type=int, nargs="+",
                        default=[1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 32])
    parser.add_argument("--threads", type=int, default=native.kernel_threads())
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
        print(f"m={m:3d}: {ms:8.2f} ms, {ms / m:6.2f} ms a row")


if __name__ == "__main__":
    main()
