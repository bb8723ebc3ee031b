"""A decode step's attention on a GPU for rows of mixed lengths: MLX with a boolean mask (its
unfused path, what mlx-lm's left-padded batch caches give), MLX without a mask (fused; only right
when no row is padded), and Rewind's kernel (rewind.kernels.cuda_attention), per layer, at
Llama-3.2-1B's heads (32 query heads, 8 key-value heads of 64) and Qwen 3.5's full-attention
layers (8 and 2 of 256). Also the largest difference from MLX's masked result.

Times are wall time per call of 50 queued calls, which a call's launch floors at ~0.04 ms; with
torch's profiler on the machine (CUPTI) each variant's GPU time per call (the sum of its
kernels' durations) is recorded beside it (`_gpu_ms`), which is what separates the kernel's
variants at one or a few rows."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rewind.bench.cupti_trace import PROFILE, traced  # torch before mlx

import mlx.core as mx  # noqa: E402


def timed(fn, reps: int = 50) -> float:
    """ms per call, `reps` calls queued and evaluated together (launch latency amortized)."""
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    start = time.perf_counter()
    outs = [fn() for _ in range(reps)]
    mx.eval(outs)
    mx.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


def gpu_ms(fn, reps: int = 20) -> float | None:
    """GPU time per call: the summed durations of the kernels `reps` calls ran (CUPTI)."""
    if PROFILE is None:
        return None
    mx.eval(fn())
    kernels = traced(lambda: mx.eval([fn() for _ in range(reps)]))
    return sum(k["dur"] for k in kernels or []) / 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/sdpa_mask_cost.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--llama-only", action="store_true",
                        help="Llama-3.2-1B's heads only (half the time)")
    args = parser.parse_args()
    from rewind.kernels.cuda_attention import available, decode_attention

    rows = []
    for heads, kv_heads, dim in ((32, 8, 64),) + (() if args.llama_only else ((8, 2, 256),)):
        # the last three: long contexts with few rows, where one block per (row, key-value
        # head) leaves most of the GPU idle
        for batch, length in ((1, 1100), (8, 1152), (32, 1152), (32, 4096),
                              (1, 8192), (1, 32768), (4, 16384)):
            q = mx.random.normal((batch, heads, 1, dim)).astype(mx.bfloat16)
            k = mx.random.normal((batch, kv_heads, length, dim)).astype(mx.bfloat16)
            v = mx.random.normal((batch, kv_heads, length, dim)).astype(mx.bfloat16)
            starts = mx.array([(37 * i) % 200 for i in range(batch)], mx.int32)
            unpadded = mx.zeros((batch,), mx.int32)
            mask = mx.arange(length)[None, None, None, :] >= starts[:, None, None, None]
            scale = dim ** -0.5
            masked_fn = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            row = {"heads": heads, "kv_heads": kv_heads, "dim": dim, "batch": batch,
                   "length": length,
                   "no_mask_ms": timed(lambda: mx.fast.scaled_dot_product_attention(
                       q, k, v, scale=scale)),
                   "bool_mask_ms": timed(masked_fn)}
            if available():
                kernel_fn = lambda: decode_attention(q, k, v, length, starts, scale)
                row["kernel_ms"] = timed(kernel_fn)
                # how a row's keys are cut: spans of at least this many keys, at most this
                # many spans (1024 / 4096: the fixed spans of 1,024 before 2026-12-07; 1 << 20:
                # one block per row and key-value head)
                for keys_per_span, max_spans in ((1024, 4096), (1 << 20, 1), (64, 16), (64, 32),
                                                 (128, 16), (128, 32), (256, 16), (32, 32),
                                                 (32, 64), (64, 64)):
                    row[f"kernel_span{keys_per_span}x{max_spans}_ms"] = timed(
                        lambda: decode_attention(q, k, v, length, starts, scale, keys_per_span,
                                                 max_spans=max_spans))
                    on_device = mx.array([length])

                    def spanned(keys_per_span=keys_per_span, max_spans=max_spans):
                        return decode_attention(q, k, v, on_device, starts, scale, keys_per_span,
                                                max_spans=max_spans)

                    row[f"kernel_span{keys_per_span}x{max_spans}_device_ms"] = timed(spanned)
                    row[f"kernel_span{keys_per_span}x{max_spans}_device_gpu_ms"] = gpu_ms(spanned)
                # elements of a key each lane loads: D / 32 (a whole warp a key, as the first
                # kernel), 4, 8 (16 bytes of bf16), 16 (two such loads: at D 256 the only way
                # for a warp to take two keys at once; ~230 registers a thread, from ptxas)
                for vec in sorted(v for v in {dim // 32, 4, 8, 16} if dim // v <= 32):
                    row[f"kernel_vec{vec}_ms"] = timed(
                        lambda: decode_attention(q, k, v, length, starts, scale,
                                                 elements_per_lane=vec))
                # no row padded: what the plain path gives MLX's fused attention instead
                row["kernel_unpadded_ms"] = timed(
                    lambda: decode_attention(q, k, v, length, unpadded, scale))
                diff = mx.abs(kernel_fn().astype(mx.float32) - masked_fn().astype(mx.float32))
                row["max_abs_diff"] = float(diff.max())
            rows.append(row)
            if PROFILE is not None:
                row["no_mask_gpu_ms"] = gpu_ms(lambda: mx.fast.scaled_dot_product_attention(
                    q, k, v, scale=scale))
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
