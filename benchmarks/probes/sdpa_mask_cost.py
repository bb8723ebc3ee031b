"""A decode step's attention on a GPU for rows of mixed lengths: MLX with a boolean mask (its
unfused path, what mlx-lm's left-padded batch caches give), MLX without a mask (fused; only right
when no row is padded), and Rewind's kernel (rewind.kernels.cuda_attention), per layer, at
Llama-3.2-1B's heads (32 query heads, 8 key-value heads of 64) and Qwen 3.5's full-attention
layers (8 and 2 of 256). Also the largest difference from MLX's masked result."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx


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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/sdpa_mask_cost.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from rewind.kernels.cuda_attention import available, decode_attention

    rows = []
    for heads, kv_heads, dim in ((32, 8, 64), (8, 2, 256)):
        # the last three: long contexts with few rows, where one block per (row, key-value
        # head) leaves most of the GPU idle
        for batch, length in ((1, 1152), (8, 1152), (32, 1152), (32, 4096),
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
                # keys per block: one block per (row, key-value head) where the row fits one
                # span, else spans of this many keys and a combine
                for keys_per_span in (256, 1024, 1 << 20):
                    row[f"kernel_span{keys_per_span}_ms"] = timed(
                        lambda: decode_attention(q, k, v, length, starts, scale, keys_per_span))
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
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
