"""Rewind's decode attention kernel as a decode step runs it: 16 layers' calls in a row, each
layer's query made from the one before's output, the length on the device (a compiled step's
form), per variant of the kernel's layout, beside MLX's fused attention (cuDNN) over the same
keys unpadded. Llama-3.2-1B's heads (32 query heads, 8 key-value heads of 64), and Qwen 3.5's
full-attention heads (8 and 2 of 256) unless --llama-only.

Two readings a variant: wall time per layer of 20 chains queued together (a chain's kernels are
launched back to back, so at a few rows the host's launch cost can hide the GPU's), and with
torch's profiler (CUPTI) the GPU time per layer: the summed durations of the chain's kernels.
Also the largest difference from MLX's masked result, so a fast variant that is wrong shows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rewind.bench.cupti_trace import PROFILE, traced  # torch before mlx

import mlx.core as mx  # noqa: E402

LAYERS = 16


def _chain(step, q0: mx.array) -> mx.array:
    q = q0
    for _ in range(LAYERS):
        q = step(q).astype(q0.dtype) + q0  # the next layer's query depends on this output
    return q


def measure(step, q0: mx.array, reps: int = 20) -> dict[str, float | None]:
    for _ in range(3):
        mx.eval(_chain(step, q0))
    mx.synchronize()
    start = time.perf_counter()
    mx.eval([_chain(step, q0) for _ in range(reps)])
    mx.synchronize()
    wall = 1e3 * (time.perf_counter() - start) / (reps * LAYERS)
    gpu = None
    if PROFILE is not None:
        kernels = traced(lambda: mx.eval([_chain(step, q0) for _ in range(reps)])) or []
        ours = [k for k in kernels if "rewind" in k["name"] or "sdpa" in k["name"].lower()
                or "cudnn" in k["name"].lower() or "flash" in k["name"].lower()]
        gpu = sum(k["dur"] for k in (ours or kernels)) / 1e3 / (reps * LAYERS)
    return {"wall_ms": round(wall, 4), "gpu_ms": None if gpu is None else round(gpu, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/attention_chain.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llama-only", action="store_true")
    parser.add_argument("--variants", nargs="+",
                        default=["default", "u1w8", "u2w8", "u4w8", "u2w4", "u4w4", "u4w2",
                                 "u4w4s64", "u4w8s256"],
                        help="uUwW[sS]: U sets of keys a warp's round takes, W warps a "
                             "block, spans of at least S keys; "
                             "default: the kernel's own (no argument: how an older tree is "
                             "timed beside this one)")
    args = parser.parse_args()
    from rewind.kernels.cuda_attention import decode_attention

    rows = []
    shapes = ((32, 8, 64),) + (() if args.llama_only else ((8, 2, 256),))
    for heads, kv_heads, dim in shapes:
        for batch, length in ((1, 1100), (1, 4096), (8, 1152), (32, 1152), (32, 4096),
                              (1, 32768)):
            capacity = length + 200
            q0 = mx.random.normal((batch, heads, 1, dim)).astype(mx.bfloat16)
            k = mx.random.normal((batch, kv_heads, capacity, dim)).astype(mx.bfloat16)
            v = mx.random.normal((batch, kv_heads, capacity, dim)).astype(mx.bfloat16)
            starts = mx.array([(37 * i) % 200 for i in range(batch)], mx.int32)
            on_device = mx.array([length])
            scale = dim ** -0.5
            row = {"heads": heads, "kv_heads": kv_heads, "dim": dim, "batch": batch,
                   "length": length}
            kd, vd = k[..., :length, :], v[..., :length, :]
            row["cudnn_unpadded"] = measure(
                lambda q: mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale), q0)
            mask = mx.arange(length)[None, None, None, :] >= starts[:, None, None, None]
            expected = mx.fast.scaled_dot_product_attention(
                q0.astype(mx.float32), kd.astype(mx.float32), vd.astype(mx.float32),
                scale=scale, mask=mask)
            for variant in args.variants:
                extra = {}
                if variant != "default":
                    unroll, rest = variant[1:].split("w")
                    warps, _, span = rest.partition("s")
                    extra = {"unroll": int(unroll), "warps": int(warps)}
                    if span:
                        extra["keys_per_span"] = int(span)

                def step(q, extra=extra):
                    return decode_attention(q, k, v, on_device, starts, scale, **extra)
                try:
                    got = step(q0)
                    diff = float(mx.abs(got.astype(mx.float32) - expected).max())
                    row[variant] = {**measure(step, q0), "max_abs_diff": diff}
                except Exception as refused:  # noqa: BLE001 - a variant that fails is a result
                    row[variant] = str(refused)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
