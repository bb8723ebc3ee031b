"""Why Rewind no longer folds a decode batch's rows for its linear layers: MLX's [B, 1, K] @ W
against the same rows folded to [1, B, K] @ W, on a GPU, at Llama-3.2-1B's layer shapes and its
tied output head (x @ E.T). Measured on an H100: the plain form was as fast or faster at every
shape (MLX already takes a contiguous batch of one-row products as one product)."""

from __future__ import annotations

import argparse
import time

import mlx.core as mx


def timed(fn, reps: int = 50) -> float:
    for _ in range(5):
        mx.eval(fn())
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/matmul_fold.py",
                                     description=__doc__.splitlines()[0])
    parser.parse_args()
    shapes = {"q_proj 2048x2048": (2048, 2048), "gate 2048x8192": (2048, 8192),
              "down 8192x2048": (8192, 2048), "head 2048x128256 (E.T)": (2048, 128256)}
    for batch in (1, 8, 32):
        for name, (k, n) in shapes.items():
            x = mx.random.normal((batch, 1, k)).astype(mx.bfloat16)
            w = mx.random.normal((n, k)).astype(mx.bfloat16)
            plain = timed(lambda: x @ w.T)
            folded = timed(lambda: (x.reshape(1, batch, k) @ w.T).reshape(batch, 1, n))
            print(f"B={batch:<3} {name:<24} [B,1,K]@W {plain:.3f} ms  folded {folded:.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
