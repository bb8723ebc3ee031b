"""What the first calls of a new shape cost on a GPU: Rewind's decode attention kernels' first
calls (one block per row and head, and the spans with their combine) in a fresh process, then
the engine's token gaps for one stream, the compiled decode step on and off, a short prompt
(capacity 256) and then two 1,024-token prompts (capacity past one span of keys): the largest
gap of each request and where it fell. Llama-3.2-1B shape, random bf16 weights.

    PYTHONPATH=src MLX_PTX_CACHE_DIR=/tmp/empty python benchmarks/probes/first_steps.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def kernel_first_calls() -> list[dict]:
    from rewind.kernels.cuda_attention import KEYS_PER_SPAN, available, decode_attention

    if not available():
        return []
    rows = []
    span = KEYS_PER_SPAN
    cases = (("one block", span - 56, 2 * span), ("spans", 4 * span + 76, 5 * span),
             ("spans, length on the device", None, 5 * span))
    for name, length, capacity in cases:
        q = mx.random.normal((2, 32, 1, 64)).astype(mx.bfloat16)
        k = mx.random.normal((2, 8, capacity, 64)).astype(mx.bfloat16)
        starts = mx.array([0, 7], mx.int32)
        mx.eval(q, k, starts)
        times = []
        for _ in range(3):
            started = time.perf_counter()
            mx.eval(decode_attention(q, k, k, length if length else mx.array([4 * span]),
                                     starts, 0.125))
            times.append(round(1e3 * (time.perf_counter() - started), 2))
        rows.append({"case": name, "first_ms": times[0], "then_ms": times[1:]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_gaps(compiled: str, work_dir: Path) -> list[dict]:
    from rewind import env
    from rewind.bench.decode_scaling_models import SHAPES, build_model, eos_ids, make_prompts
    from rewind.config import EngineConfig
    from rewind.engine import Engine, GenerationRequest, SamplingParams

    family, overrides = SHAPES["llama-3.2-1b"]
    loaded = build_model("llama-3.2-1b", family, overrides, work_dir)
    bias = {t: -100.0 for t in eos_ids(loaded)}
    rows = []
    with env.overridden({env.COMPILED_DECODE: compiled}):
        with Engine(loaded, EngineConfig(parallel=1)) as engine:
            for seed, length in ((1, 64), (2, 1024), (3, 1024)):
                prompt = make_prompts(1, length, overrides["vocab_size"], seed)[0]
                handle = engine.submit(GenerationRequest(prompt, SamplingParams(
                    temperature=0.0, max_tokens=24, logit_bias=bias)))
                stamps = [time.perf_counter()]
                for event in handle.events(600):
                    if getattr(event, "token", None) is not None:
                        stamps.append(time.perf_counter())
                gaps = [1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]
                worst = max(range(len(gaps)), key=gaps.__getitem__)
                rows.append({"compiled": compiled, "prompt": length,
                             "first_token_ms": round(1e3 * (stamps[1] - stamps[0]), 1),
                             "gap_max_ms": round(gaps[worst], 1), "gap_max_at": worst,
                             "gap_median_ms": round(sorted(gaps)[len(gaps) // 2], 2)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/first_steps.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--modes", nargs="+", default=["on", "off"])
    args = parser.parse_args()
    report = {"device": str(mx.default_device()), "kernel": kernel_first_calls()}
    with tempfile.TemporaryDirectory() as work:
        report["engine"] = [row for mode in args.modes for row in engine_gaps(mode, Path(work))]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
