"""Rewind's decode-sized product kernel (rewind.kernels.cuda_gemv) against MLX's products, on a
CUDA GPU (issue 27: a one-stream step is bound by MLX's host work per kernel, and MLX's one-row
product reads the weights at about half the card's bandwidth).

A developer probe, run from the repository root as its own process (torch, where it has CUDA,
is imported first so that its profiler records MLX's kernels through CUPTI):

    PYTHONPATH=src python benchmarks/probes/decode_gemv.py --json OUT.json

Three parts:
1. check: the kernel against float32 products (plain, RMS norm folded in, gated MLP), each row
   the bits of the same row alone, and the unaligned copy of the loop the same bits.
2. kernels: GPU time of one product at Llama-3.2-1B's shapes and 1-16 rows, MLX's against the
   kernel's (16 copies of each weight, so that L2 holds none), as GB/s of weights read.
3. stack: a 16-layer Llama-3.2-1B-shaped step without attention (norm, qkv product, o product
   and residual, norm, gate/up product, silu * up, down product and residual; the head and an
   argmax feeding the next step's embedding), under mx.compile, pipelined as the engine decodes,
   MLX's ops against the kernel with norms and activation folded in: wall time a step, GPU busy
   time and kernels a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rewind.bench.cupti_trace import PROFILE, busy_us, traced  # torch before mlx

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from rewind.kernels import cuda_gemv  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 2048, 8192, 128256, 16
SHAPES = {"qkv": (3072, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "head": (VOCAB, HIDDEN)}


def _normal(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> mx.array:
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(mx.bfloat16)


def check() -> dict[str, Any]:
    results: dict[str, Any] = {}
    eps = 1e-5
    for rows in (1, 2, 3, 5, 8, 13, 32):
        for n, k in ((3072, 2048), (2048, 8192), (1000, 520)):
            x, w = _normal((rows, k), 1), _normal((n, k), 2, 0.02)
            g = _normal((k,), 3, 0.5) + 1
            ref = x.astype(mx.float32) @ w.astype(mx.float32).T
            ours = cuda_gemv.linear(x, w)
            normed = mx.fast.rms_norm(x.astype(mx.float32), g.astype(mx.float32), eps)
            ref_norm = normed @ w.astype(mx.float32).T
            ours_norm = cuda_gemv.linear(x, w, norm=(g, eps))
            half = n // 2
            gate, up = ref[:, :half].astype(mx.bfloat16), ref[:, half:].astype(mx.bfloat16)
            ref_gated = (nn.silu(gate.astype(mx.float32)) * up.astype(mx.float32))
            ours_gated = cuda_gemv.linear(x, w, gated=True)
            alone = mx.concatenate([cuda_gemv.linear(x[r:r + 1], w) for r in range(rows)])
            alone_norm = mx.concatenate([cuda_gemv.linear(x[r:r + 1], w, norm=(g, eps))
                                         for r in range(rows)])
            # a view one element in: the unaligned loop
            flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), x.reshape(-1)])
            shifted = flat[1:].reshape(rows, k)
            ours_shifted = cuda_gemv.linear(shifted, w)

            def err(a: mx.array, b: mx.array) -> float:
                scale = mx.abs(b).max().item() or 1.0
                return float(mx.abs(a.astype(mx.float32) - b).max().item() / scale)

            results[f"{rows}x{n}x{k}"] = {
                "plain_rel_err": err(ours, ref), "norm_rel_err": err(ours_norm, ref_norm),
                "gated_rel_err": err(ours_gated, ref_gated),
                "rows_alone": bool(mx.array_equal(alone, ours).item()),
                "rows_alone_norm": bool(mx.array_equal(alone_norm, ours_norm).item()),
                "unaligned_same_bits": bool(mx.array_equal(ours_shifted, ours).item()),
            }
    ok = all(v["rows_alone"] and v["rows_alone_norm"] and v["unaligned_same_bits"]
             and v["plain_rel_err"] < 1e-2 and v["norm_rel_err"] < 1e-2
             and v["gated_rel_err"] < 2e-2 for v in results.values())
    return {"ok": ok, "cases": results}


def _gpu_us(run: Callable[[], None], count: int) -> tuple[float, int]:
    kernels = traced(run)
    if kernels is None:
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6 / count, -1
    return sum(k["dur"] for k in kernels) / count, len(kernels)


def kernels(rows_list: list[int], copies: int = 16) -> list[dict[str, Any]]:
    out = []
    for name, (n, k) in SHAPES.items():
        weights = [_normal((n, k), 10 + c, 0.02) for c in range(copies if name != "head" else 4)]
        mx.eval(weights)
        for rows in rows_list:
            x = _normal((rows, k), 5)
            mx.eval(x)
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "rows": rows}
            for label, fn in (("mlx", lambda w: x @ w.T),
                              ("rewind", lambda w: cuda_gemv.linear(x, w))):
                mx.eval([fn(w) for w in weights])  # compile, warm

                def run() -> None:
                    for _ in range(3):
                        mx.eval([fn(w) for w in weights])

                us, launched = _gpu_us(run, 3 * len(weights))
                row[f"{label}_us"] = round(us, 2)
                row[f"{label}_gbps"] = round(n * k * 2 / us / 1e3, 1)
                row[f"{label}_kernels"] = launched
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


class Stack:
    """The step's weights: LAYERS layers of Llama-3.2-1B's products, norms, a tied head."""

    def __init__(self) -> None:
        s = 0.02
        self.layers = [{"qkv": _normal((3072, HIDDEN), 100 + i, s),
                        "o": _normal((HIDDEN, HIDDEN), 200 + i, s),
                        "gate_up": _normal((2 * INTER, HIDDEN), 300 + i, s),
                        "down": _normal((HIDDEN, INTER), 400 + i, s),
                        "n1": _normal((HIDDEN,), 500 + i, 0.1) + 1,
                        "n2": _normal((HIDDEN,), 600 + i, 0.1) + 1} for i in range(LAYERS)]
        self.embed = _normal((VOCAB, HIDDEN), 7, s)
        self.final = _normal((HIDDEN,), 8, 0.1) + 1
        mx.eval(self.layers, self.embed, self.final)

    def step_mlx(self, tokens: mx.array) -> mx.array:
        h = self.embed[tokens]
        for p in self.layers:
            qkv = mx.fast.rms_norm(h, p["n1"], 1e-5) @ p["qkv"].T
            h = h + qkv[..., :HIDDEN] @ p["o"].T
            gu = mx.fast.rms_norm(h, p["n2"], 1e-5) @ p["gate_up"].T
            h = h + (nn.silu(gu[..., :INTER]) * gu[..., INTER:]) @ p["down"].T
        logits = mx.fast.rms_norm(h, self.final, 1e-5) @ self.embed.T
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def step_rewind(self, tokens: mx.array) -> mx.array:
        h = self.embed[tokens]
        for p in self.layers:
            qkv = cuda_gemv.linear(h, p["qkv"], norm=(p["n1"], 1e-5))
            h = h + cuda_gemv.linear(qkv[..., :HIDDEN], p["o"])
            m = cuda_gemv.linear(h, p["gate_up"], norm=(p["n2"], 1e-5), gated=True)
            h = h + cuda_gemv.linear(m, p["down"])
        logits = cuda_gemv.linear(h, self.embed, norm=(self.final, 1e-5))
        return mx.argmax(logits, axis=-1).astype(mx.int32)


def stack(rows_list: list[int], steps: int) -> list[dict[str, Any]]:
    model = Stack()
    out = []
    for rows in rows_list:
        for label, fn in (("mlx", model.step_mlx), ("rewind", model.step_rewind),
                          ("mlx", model.step_mlx), ("rewind", model.step_rewind)):
            step = mx.compile(fn)
            tokens = mx.arange(rows, dtype=mx.int32) * 7 + 3

            def loop(count: int, tokens: mx.array = tokens) -> tuple[mx.array, list[float]]:
                times = []
                nxt = step(tokens)
                mx.async_eval(nxt)
                for _ in range(count):
                    t0 = time.perf_counter()
                    after = step(nxt)
                    mx.async_eval(after)
                    nxt.tolist()
                    nxt = after
                    times.append(time.perf_counter() - t0)
                mx.eval(nxt)
                return nxt, times

            loop(8)
            last, times = loop(steps)
            holder: dict[str, Any] = {}
            kernels_seen = traced(lambda: holder.update(t=loop(20)[1]))
            row = {"variant": label, "rows": rows,
                   "step_ms_median": round(statistics.median(times) * 1e3, 3),
                   "tokens_per_s": round(rows / statistics.median(times), 1),
                   "last_tokens": last.tolist()[:4]}
            if kernels_seen is not None:
                row["gpu_busy_ms_per_step"] = round(busy_us(kernels_seen) / 21 / 1e3, 3)
                row["kernels_per_step"] = round(len(kernels_seen) / 21, 1)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["check", "kernels", "stack"],
                        choices=["check", "kernels", "stack"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--stack-rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not cuda_gemv.available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"mlx": mx.__version__, "traced": PROFILE is not None}
    if "check" in args.parts:
        report["check"] = check()
        print("check ok:", report["check"]["ok"], flush=True)
        if not report["check"]["ok"]:
            print(json.dumps(report["check"], indent=1))
    if "kernels" in args.parts:
        report["kernels"] = kernels(args.rows)
    if "stack" in args.parts:
        report["stack"] = stack(args.stack_rows, args.steps)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report.get("check", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
