"""Attention on the CPU: mx.fast.scaled_dot_product_attention vs Rewind's C kernel
(rewind.kernels.cpu_attention), same inputs, side by side.

Shapes are Gemma 3 270M's (4 query heads sharing 1 key/value head of 256), float32 keys and
values as the CPU path's caches hold them: a prefill chunk of L queries over S keys (causal,
aligned to the last key), and a decode step (one query, no mask). Each figure is the median of
`--runs` timed calls after one untimed call; the kernel's output is checked against MLX's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from timing import median_seconds  # beside this script

RESULTS = Path("benchmarks/results")
DEFAULT_SHAPES = ("512x512", "512x4096", "512x8704", "1x512", "1x8704")
HEADS, KV_HEADS, HEAD_DIM = 4, 1, 256


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), metavar="LxS",
                        help="query positions x keys (L=1: a decode step)")
    parser.add_argument("--runs", type=int, default=7, help="timed calls per shape and path")
    parser.add_argument("--json", type=Path, default=RESULTS / "attention.json",
                        help="JSON output; the Markdown table goes beside it (.md)")


def _median_ms(call: Any, runs: int) -> float:
    return median_seconds(call, runs) * 1000


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from rewind import blas
    from rewind.bench.machine import command_line, machine_info, machine_markdown
    from rewind.kernels.cpu_attention import attention

    if mx.default_device() != mx.cpu:
        raise SystemExit("benchmarks/probes/cpu_attention.py measures the CPU backend")
    rows = []
    for shape in args.shapes:
        length, total = (int(part) for part in shape.lower().split("x"))
        key = mx.random.key(length * 100_003 + total)
        k1, k2, k3 = mx.random.split(key, 3)
        queries = mx.random.normal((1, HEADS, length, HEAD_DIM), key=k1)
        keys = mx.random.normal((1, KV_HEADS, total, HEAD_DIM), key=k2)
        values = mx.random.normal((1, KV_HEADS, total, HEAD_DIM), key=k3)
        mx.eval(queries, keys, values)
        mask = "causal" if length > 1 else None
        scale = HEAD_DIM ** -0.5

        def mlx_call() -> None:
            mx.eval(mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                         mask=mask))

        def kernel_call() -> None:
            if attention(queries, keys, values, scale, mask) is None:
                raise SystemExit("the C attention kernel is not available here")

        expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                        mask=mask)
        error = float(mx.abs(attention(queries, keys, values, scale, mask) - expected).max())
        mlx_ms, kernel_ms = _median_ms(mlx_call, args.runs), _median_ms(kernel_call, args.runs)
        rows.append({"queries": length, "keys": total, "mask": mask or "none",
                     "mlx_ms": round(mlx_ms, 3), "rewind_ms": round(kernel_ms, 3),
                     "speedup": round(mlx_ms / kernel_ms, 1), "max_abs_difference": error})
        print(f"L={length:<5} S={total:<6} MLX {mlx_ms:8.2f} ms   Rewind {kernel_ms:7.2f} ms   "
              f"x{mlx_ms / kernel_ms:.1f}   max |diff| {error:.1e}", flush=True)
    report = {"command": command_line(), "blas": blas.status(), "runs": args.runs,
              "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rows": rows,
              "machine": machine_info()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Attention on the CPU: MLX vs Rewind's kernel", "",
             f"Command: `{report['command']}`", "",
             f"{HEADS} query heads, {KV_HEADS} key/value head of {HEAD_DIM} (Gemma 3 270M), float32;"
             f" median of {args.runs} calls. {report['blas']}.", "",
             "| queries | keys | mask | MLX ms | Rewind ms | speed-up | max abs difference |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['queries']} | {r['keys']} | {r['mask']} | {r['mlx_ms']:.2f} | "
              f"{r['rewind_ms']:.2f} | {r['speedup']:.1f}x | {r['max_abs_difference']:.1e} |"
              for r in rows]
    lines += ["", "## Machine", "", machine_markdown(report["machine"]), ""]
    args.json.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {args.json} and {args.json.with_suffix('.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/cpu_attention.py",
                                     description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv)) or 0


if __name__ == "__main__":
    sys.exit(main())
