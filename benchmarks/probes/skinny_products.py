"""A decode batch's matrix products on CUDA: rewind.kernels.cuda_skinny against MLX's matmul
(cuBLAS for more than one row), for a Llama-3.2-1B layer's weight shapes and its head.

- Accuracy: each product's largest difference from a float32 product of the same bf16 inputs,
  relative to the output's largest magnitude, for both.
- A step's products: 16 layers' q/k/v, o, gate/up and down and the head (65 products, random
  bf16 weights), each step's outputs evaluated with `mx.async_eval` as the engine does, STEPS
  steps in flight one behind the other: the host time of building and `async_eval` a step, and
  the wall time a step (the larger of the host's and the GPU's).

Usage: python benchmarks/probes/skinny_products.py [--rows 2 8 16 32] [--steps 40] [--compiled]
       [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from rewind.kernels import cuda_skinny  # noqa: E402

HIDDEN, QKV, INTERMEDIATE, VOCAB, LAYERS = 2048, 3072, 8192, 128256, 16


def shapes() -> list[tuple[str, int, int]]:
    return [("qkv", QKV, HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", 2 * INTERMEDIATE, HIDDEN),
            ("down", HIDDEN, INTERMEDIATE), ("head", VOCAB, HIDDEN)]


def accuracy(rows: int, dtype: mx.Dtype) -> list[dict]:
    out = []
    for name, n, k in shapes():
        w = (mx.random.normal((n, k), key=mx.random.key(n + k)) * 0.02).astype(dtype)
        x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(dtype)
        exact = x.astype(mx.float32) @ w.astype(mx.float32).T
        scale = mx.max(mx.abs(exact)).item()
        ours = mx.max(mx.abs(cuda_skinny.matmul(x, w).astype(mx.float32) - exact)).item()
        mlx = mx.max(mx.abs((x @ w.T).astype(mx.float32) - exact)).item()
        out.append({"product": name, "rows": rows, "dtype": str(dtype),
                    "skinny_rel": ours / scale, "mlx_rel": mlx / scale})
    return out


def step_times(rows: int, steps: int, skinny: bool, w_tiles: int | None = None,
               compiled: bool = False) -> dict:
    # None: cuda_skinny.tiling_for's choice for each product
    tiling = None if w_tiles is None else cuda_skinny.Tiling(w_tiles=w_tiles)
    weights = []
    for layer in range(LAYERS):
        for name, n, k in shapes()[:4]:
            weights.append((mx.random.normal((n, k), key=mx.random.key(layer * 7 + n)) * 0.02)
                           .astype(mx.bfloat16))
    head = (mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
    weights.append(head)
    inputs = {k: mx.random.normal((rows, k), key=mx.random.key(k)).astype(mx.bfloat16)
              for k in (HIDDEN, INTERMEDIATE)}
    mx.eval(weights, list(inputs.values()))

    def product(x: mx.array, w: mx.array) -> mx.array:
        if skinny and cuda_skinny.takes(x.shape[0], w, x.dtype):
            return cuda_skinny.matmul(x, w, tiling)
        return x @ w.T

    def step(x_hidden: mx.array, x_intermediate: mx.array) -> list[mx.array]:
        xs = {HIDDEN: x_hidden, INTERMEDIATE: x_intermediate}
        return [product(xs[w.shape[1]], w) for w in weights]

    # compiled as the engine's decode step is: the Python of each call runs once, at the trace
    run = mx.compile(step) if compiled else step
    xs = (inputs[HIDDEN], inputs[INTERMEDIATE])
    for _ in range(3):  # builds the kernels and cuBLAS's plans (and the trace)
        mx.eval(run(*xs))
    host = []
    previous = None
    start = time.perf_counter()
    for _ in range(steps):
        began = time.perf_counter()
        outs = run(*xs)
        mx.async_eval(outs)
        host.append(time.perf_counter() - began)
        if previous is not None:
            mx.eval(previous)
        previous = outs
    mx.eval(previous)
    wall = (time.perf_counter() - start) / steps
    host.sort()
    label = "tiling_for" if w_tiles is None else f"{w_tiles} W tiles"
    return {"rows": rows, "kernel": f"skinny, {label}" if skinny else "mlx",
            "compiled": compiled,
            "host_ms": round(1e3 * host[len(host) // 2], 3), "wall_ms": round(1e3 * wall, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python benchmarks/probes/{Path(__file__).name}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--compiled", action="store_true",
                        help="each step's products through mx.compile, as the engine's decode "
                             "step runs them (host time without each call's Python)")
    args = parser.parse_args()
    if not cuda_skinny.available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    report = {"accuracy": [], "steps": []}
    for dtype in (mx.bfloat16, mx.float16):
        for rows in (2, 5, 8, 17, 32):
            report["accuracy"] += accuracy(rows, dtype)
    print("| product | rows | dtype | skinny off by (rel.) | MLX off by (rel.) |")
    print("| --- | ---: | --- | ---: | ---: |")
    for row in report["accuracy"]:
        print(f"| {row['product']} | {row['rows']} | {row['dtype']} | "
              f"{row['skinny_rel']:.2e} | {row['mlx_rel']:.2e} |")
    print()
    print("| rows | MLX host ms | MLX wall ms | skinny (tiling_for) host ms | wall ms | "
          "skinny, 2 W tiles a block: host ms | wall ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    one = step_times(1, args.steps, False, compiled=args.compiled)
    print(f"| 1 (MLX's gemv) | {one['host_ms']} | {one['wall_ms']} | - | - | - | - |", flush=True)
    report["steps"].append(one)
    for rows in args.rows:
        mlx = step_times(rows, args.steps, False, compiled=args.compiled)
        ours = step_times(rows, args.steps, True, compiled=args.compiled)
        wide = step_times(rows, args.steps, True, 2, compiled=args.compiled)
        report["steps"] += [mlx, ours, wide]
        print(f"| {rows} | {mlx['host_ms']} | {mlx['wall_ms']} | {ours['host_ms']} | "
              f"{ours['wall_ms']} | {wide['host_ms']} | {wide['wall_ms']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
