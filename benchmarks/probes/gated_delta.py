"""The gated delta rule: mlx-lm's `gated_delta_ops` (a Python loop of small graphs) vs Rewind's
kernel for this backend (the C kernel on the CPU, the CUDA kernel on NVIDIA GPUs;
rewind.kernels.gated_delta), side by side.

Two parts: the recurrence alone on one layer's shapes (`--heads` key x value heads of
`--head-dim`, as Qwen 3.5 / Qwen3-Next linear attention), for a decode step and prefill chunks;
and a whole prefill of a random-weight Qwen 3.5 model of `--model-size` through Rewind's loader
(on the CPU: MLX layers in float32, OpenBLAS where preloaded; on a GPU: bf16), with the kernel
and with REWIND_GATED_DELTA=off in the same process, the last position's logits compared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from timing import median_seconds  # beside this script

RESULTS = Path("benchmarks/results")
# A Qwen 3.5 0.8B-like shape (random weights; only the timings mean anything). Vocabulary cut
# to 32k: the head is not what this measures.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "0.8b": {"hidden_size": 1024, "num_hidden_layers": 24, "full_attention_interval": 4,
             "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 256, "linear_num_value_heads": 16, "linear_num_key_heads": 16,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 32000},
}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", nargs="+", type=int, default=[1, 64, 512],
                        help="tokens per call for the recurrence alone (1: a decode step)")
    parser.add_argument("--heads", default="16x16", metavar="KxV",
                        help="key heads x value heads of one linear attention layer")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5, help="timed calls per shape and path")
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="0.8b")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="prompt of the whole-model prefill (0 skips it)")
    parser.add_argument("--json", type=Path, default=RESULTS / "gated-delta.json",
                        help="JSON output; the Markdown table goes beside it (.md)")


def _recurrence_rows(args: argparse.Namespace, recurrence: Any) -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_ops

    key_heads, value_heads = (int(part) for part in args.heads.lower().split("x"))
    dim = args.head_dim
    rows = []
    for steps in args.steps:
        keys = mx.random.split(mx.random.key(steps), 6)
        q = mx.random.normal((1, steps, key_heads, dim), key=keys[0]) * dim ** -0.5
        k = mx.random.normal((1, steps, key_heads, dim), key=keys[1]) * dim ** -0.5
        v = mx.random.normal((1, steps, value_heads, dim), key=keys[2])
        g = mx.random.uniform(0.9, 1.0, (1, steps, value_heads), key=keys[3])
        beta = mx.random.uniform(0.0, 1.0, (1, steps, value_heads), key=keys[4])
        state = mx.random.normal((1, value_heads, dim, dim), key=keys[5])
        mx.eval(q, k, v, g, beta, state)
        expected, _ = gated_delta_ops(q, k, v, g, beta, state)
        got, _ = recurrence(q, k, v, g, beta, state)
        error = float(mx.abs(got - expected).max())
        ops_s = median_seconds(lambda: mx.eval(gated_delta_ops(q, k, v, g, beta, state)),
                               args.runs)
        kernel_s = median_seconds(lambda: mx.eval(recurrence(q, k, v, g, beta, state)),
                                  args.runs)
        rows.append({"steps": steps, "ops_ms": round(ops_s * 1000, 3),
                     "rewind_ms": round(kernel_s * 1000, 3),
                     "speedup": round(ops_s / kernel_s, 1), "max_abs_difference": error})
        print(f"T={steps:<5} mlx-lm ops {ops_s * 1000:9.2f} ms   Rewind {kernel_s * 1000:8.2f} ms"
              f"   x{ops_s / kernel_s:.1f}   max |diff| {error:.1e}", flush=True)
    return rows


def _prefill_row(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from rewind import env
    from rewind.cache.kv import make_cache
    from rewind.engine.forward import last_logits
    from rewind.models.loader import load_model
    from rewind.testing.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="rewind-gated-delta-") as scratch:
        print(f"building a random Qwen 3.5 {args.model_size}-sized model ...", flush=True)
        folder = build_tiny_model("qwen3_5", Path(scratch), overrides=MODEL_SIZES[args.model_size])
        loaded = load_model(str(folder))
    model = loaded.model
    prompt = mx.array([[3 + (i * 7919) % 30000 for i in range(args.prompt_tokens)]])

    def prefill() -> mx.array:
        logits = last_logits(model, prompt, make_cache(model))
        mx.eval(logits)
        return logits

    timings, logits = {}, {}
    for path in ("rewind", "off", "rewind", "off"):  # alternate, keep the second of each
        with env.overridden({env.GATED_DELTA: "on" if path == "rewind" else "off"}):
            started = time.perf_counter()
            logits[path] = prefill()
            timings[path] = time.perf_counter() - started
        print(f"prefill {args.prompt_tokens} tokens, gated delta "
              f"{'in Rewind' if path == 'rewind' else 'in mlx-lm ops'}: {timings[path]:.2f} s",
              flush=True)
    scale = max(1.0, float(mx.abs(logits["off"]).max()))
    from rewind.models.loader import describe_compute

    return {"model_size": args.model_size, "prompt_tokens": args.prompt_tokens,
            "compute": describe_compute(model),
            "rewind_s": round(timings["rewind"], 3), "ops_s": round(timings["off"], 3),
            "rewind_tok_s": round(args.prompt_tokens / timings["rewind"], 1),
            "ops_tok_s": round(args.prompt_tokens / timings["off"], 1),
            "speedup": round(timings["off"] / timings["rewind"], 2),
            "max_rel_logit_difference": float(mx.abs(logits["rewind"] - logits["off"]).max())
            / scale}


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from rewind import blas
    from rewind.bench.machine import command_line, machine_info, machine_markdown
    from rewind.kernels import gated_delta

    chosen = gated_delta._recurrence(mx.zeros((1, 1, 1, args.head_dim)))
    if chosen is None:
        raise SystemExit("benchmarks/probes/gated_delta.py: Rewind has no gated delta kernel for this "
                         "backend here (the CPU's needs x86-64 AVX2 and a C compiler; the "
                         "GPU's, CUDA)")
    backend, recurrence = chosen
    rows = _recurrence_rows(args, recurrence)
    prefill = _prefill_row(args) if args.prompt_tokens > 0 else None
    report = {"command": command_line(), "backend": backend, "blas": blas.status(),
              "runs": args.runs,
              "heads": args.heads, "head_dim": args.head_dim, "rows": rows,
              "prefill": prefill, "machine": machine_info()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# The gated delta rule on the {backend.upper()}: mlx-lm's ops vs Rewind's kernel",
             "",
             f"Command: `{report['command']}`", "",
             f"One layer: {args.heads} key x value heads of {args.head_dim}, float32, one "
             f"sequence; median of {args.runs} calls. {report['blas']}.", "",
             "| tokens per call | mlx-lm ops ms | Rewind ms | speed-up | max abs difference |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['steps']} | {r['ops_ms']:.2f} | {r['rewind_ms']:.2f} | {r['speedup']:.1f}x "
              f"| {r['max_abs_difference']:.1e} |" for r in rows]
    if prefill is not None:
        lines += ["", f"Whole prefill, random-weight Qwen 3.5 {prefill['model_size']}-sized model "
                  f"({prefill['compute']}), {prefill['prompt_tokens']} tokens, the second of two "
                  "alternating runs each:", "",
                  "| gated delta rule | prefill s | tokens/s |", "| --- | ---: | ---: |",
                  f"| mlx-lm ops | {prefill['ops_s']:.2f} | {prefill['ops_tok_s']:.1f} |",
                  f"| Rewind's kernel | {prefill['rewind_s']:.2f} | {prefill['rewind_tok_s']:.1f} |",
                  "", f"Speed-up {prefill['speedup']:.2f}x; last-position logits agree within "
                  f"{prefill['max_rel_logit_difference']:.1e} (relative to the largest)."]
    lines += ["", "## Machine", "", machine_markdown(report["machine"]), ""]
    args.json.with_suffix(".md").write_text("\n".join(lines))
    print(f"wrote {args.json} and {args.json.with_suffix('.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/gated_delta.py",
                                     description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv)) or 0


if __name__ == "__main__":
    sys.exit(main())
