"""Whether a drafted row's check can compute each position alone on CUDA, and what it costs:
issue 26's way to exact speculation on GPUs (rewind.kernels.cuda_rows, cuda_attention).

1. Products: rewind.kernels.cuda_rows.matmul over P rows against MLX's one-row product (gemv)
   row by row (bits equal?) and MLX's own P-row product (cuBLAS), with times, at Llama-3.2-1B's
   and Qwen 3.5 0.8B's shapes.
2. Attention: decode_attention with P positions against P one-token calls (bits equal?).
3. Batches: whether MLX's own product (cuBLAS for more than one row) gives a row the same bits
   whatever the number of rows M beside it (M >= 2): if so, rows of a batch could check drafts
   exactly with MLX's products, a lone row padded to two.
4. A whole random model (Llama-3.2-1B shape, bf16): P tokens one step at a time against one
   call of P positions inside cuda_rows.rows_alone (hidden states and logits, bits equal?),
   and the two calls' times.

    PYTHONPATH=src python benchmarks/probes/row_alone.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx


# Llama-3.2-1B's products: (name, K, N) of a [rows, K] @ [K, N]
LLAMA_SHAPES = [("q_proj", 2048, 2048), ("qkv fused", 2048, 3072), ("gate+up fused", 2048, 16384),
                ("down", 8192, 2048), ("head", 2048, 128256)]


def median_ms(call: Callable[[], Any], repeats: int = 20) -> float:
    mx.eval(call())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(call())
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


def product_rows(quick: bool) -> list[dict[str, Any]]:
    from rewind.kernels import cuda_rows

    shapes = [*LLAMA_SHAPES, ("qwen3.5 out", 1024, 1024),
              ("k % 128 = 64", 960, 2560), ("k % 64 = 32", 800, 1024)]
    if quick:
        shapes = shapes[:1] + shapes[-2:]
    rows = []
    for name, k, n in shapes:
        weight = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        mx.eval(weight)
        for count in (1, 2, 5, 9, 17, 33):
            x = mx.random.normal((1, count, k)).astype(mx.bfloat16)
            mx.eval(x)
            ours = cuda_rows.matmul(x, weight)
            one_by_one = mx.concatenate([x[:, p:p + 1, :] @ weight.T for p in range(count)], axis=1)
            together = x @ weight.T
            rows.append({
                "piece": f"{name} {k}x{n}", "rows": count,
                "equal_to_one_row_products": same(ours, one_by_one),
                "mlx_rows_equal_to_one_row": same(together, one_by_one),
                "max_diff_vs_one_row": float(mx.abs(ours.astype(mx.float32)
                                                    - one_by_one.astype(mx.float32)).max().item()),
                "ours_ms": median_ms(lambda: cuda_rows.matmul(x, weight)),
                "mlx_ms": median_ms(lambda: x @ weight.T),
                "mlx_one_row_ms": median_ms(lambda: x[:, :1, :] @ weight.T),
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def batch_rows(quick: bool) -> list[dict[str, Any]]:
    shapes = LLAMA_SHAPES[:1] if quick else LLAMA_SHAPES
    counts = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 40, 64, 65, 96, 128, 256)
    rows = []
    for name, k, n in shapes:
        weight = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        x = mx.random.normal((1, max(counts), k)).astype(mx.bfloat16)
        mx.eval(weight, x)
        two = x[:, :2, :] @ weight.T
        largest = x @ weight.T
        for count in counts:
            product = x[:, :count, :] @ weight.T
            rows.append({
                "piece": f"{name} {k}x{n}", "rows": count,
                "first_two_equal_to_two_row_product": same(product[:, :2, :], two),
                "equal_to_rows_of_largest": same(product, largest[:, :count, :]),
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def attention_rows(quick: bool) -> list[dict[str, Any]]:
    from rewind.kernels.cuda_attention import decode_attention

    rows = []
    for heads, kv_heads, dim in ((32, 8, 64), (8, 2, 256)):
        for length in ((300,) if quick else (300, 1500, 5000)):
            capacity = length + 200
            keys = mx.random.normal((1, kv_heads, capacity, dim)).astype(mx.bfloat16)
            values = mx.random.normal((1, kv_heads, capacity, dim)).astype(mx.bfloat16)
            for count in (1, 5, 17):
                queries = mx.random.normal((1, heads, count, dim)).astype(mx.bfloat16)
                starts = mx.zeros((1,), mx.int32)
                ours = decode_attention(queries, keys, values, length, starts, dim ** -0.5)
                singles = mx.concatenate([
                    decode_attention(queries[:, :, p:p + 1, :], keys, values,
                                     length - (count - 1 - p), starts, dim ** -0.5)
                    for p in range(count)], axis=2)
                device_length = mx.array([length], mx.int32)
                compiled_like = decode_attention(queries[:, :, -1:, :], keys, values,
                                                 device_length, starts, dim ** -0.5)
                rows.append({
                    "piece": f"attention {heads}/{kv_heads}x{dim}", "keys": length,
                    "positions": count, "equal_to_one_token_calls": same(ours, singles),
                    "last_equal_to_device_length_call": same(ours[:, :, -1:, :], compiled_like),
                    "ours_ms": median_ms(lambda: decode_attention(
                        queries, keys, values, length, starts, dim ** -0.5)),
                    "one_token_ms": median_ms(lambda: decode_attention(
                        queries[:, :, :1, :], keys, values, length, starts, dim ** -0.5)),
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def model_rows(quick: bool) -> list[dict[str, Any]]:
    from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_model, make_prompts
    from rewind.cache.kv import make_cache
    from rewind.kernels import cuda_rows
    from rewind.kernels.model_split import split_model

    name = "llama-tiny" if quick else "llama-3.2-1b"
    shapes = {**SHAPES, **QUICK_SHAPES}
    if name not in shapes:
        name = next(iter(QUICK_SHAPES if quick else SHAPES))
    family, overrides = shapes[name]
    work = Path(tempfile.gettempdir()) / "rewind-probe-models"
    loaded = build_model(name, family, overrides, work)
    model = loaded.model
    split = split_model(model)
    vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
    rows = []
    for prefix in (40, 700, 3000):
        prompt = make_prompts(1, prefix + 17, vocab, seed=prefix)[0]
        base, tail = prompt[:prefix], prompt[prefix:]

        def prefilled() -> list[Any]:
            cache = make_cache(model)
            mx.eval(split.backbone(mx.array([base]), cache=cache))
            return cache

        for count in (1, 5, 17):
            cache = prefilled()
            steps = [split.backbone(mx.array([[t]]), cache=cache) for t in tail[:count]]
            mx.eval(steps)
            stepped = mx.concatenate(steps, axis=1)
            cache = prefilled()
            with cuda_rows.rows_alone():
                together = split.backbone(mx.array([tail[:count]]), cache=cache)
                mx.eval(together)
            logits_steps = [split.logits(stepped[:, p, :]) for p in range(count)]
            logits_together = [split.logits(together[:, p, :]) for p in range(count)]
            kept = [p for p in range(count) if same(logits_steps[p], logits_together[p])]
            rows_head = cuda_rows.head_of(split.head)
            head_rows = (None if rows_head is None
                         else split.logits(together, rows_head))
            head_kept = (None if head_rows is None else
                         sum(same(logits_steps[p], head_rows[:, p, :]) for p in range(count)))

            def one_step() -> Any:
                c = prefilled()
                mx.eval(c)
                started = time.perf_counter()
                mx.eval(split.backbone(mx.array([[tail[0]]]), cache=c))
                return time.perf_counter() - started

            def checked() -> Any:
                c = prefilled()
                mx.eval(c)
                started = time.perf_counter()
                with cuda_rows.rows_alone():
                    mx.eval(split.backbone(mx.array([tail[:count]]), cache=c))
                return time.perf_counter() - started

            rows.append({
                "piece": f"{name} backbone", "prefix": prefix, "positions": count,
                "hidden_equal": same(stepped, together),
                "positions_with_equal_logits": len(kept),
                "positions_with_equal_logits_rows_head": head_kept,
                "max_hidden_diff": float(mx.abs(stepped.astype(mx.float32)
                                                - together.astype(mx.float32)).max().item()),
                "one_token_call_ms": statistics.median(one_step() for _ in range(5)) * 1e3,
                "positions_call_ms": statistics.median(checked() for _ in range(5)) * 1e3,
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python benchmarks/probes/{Path(__file__).name}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--parts", default="products,batches,attention,model")
    args = parser.parse_args()
    from rewind.kernels import cuda_rows

    if not cuda_rows.available():
        print("needs MLX's CUDA backend")
        return 0
    parts = args.parts.split(",")
    out: dict[str, Any] = {"mlx": mx.__version__}
    for part, run in (("products", product_rows), ("batches", batch_rows),
                      ("attention", attention_rows),
                      ("model", model_rows)):
        if part in parts:
            try:
                out[part] = run(args.quick)
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on to the next part
                import traceback

                traceback.print_exc()
                out[part] = {"error": repr(exc)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
