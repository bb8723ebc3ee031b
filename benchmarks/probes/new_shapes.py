"""What a shape MLX has not run before costs, on whatever device MLX has: a cached turn's tail
chunk is a length no earlier prompt had, and on CUDA each new shape may build kernels or plans.

Times the first and the second call at each of several new lengths, for the pieces of a hybrid
model's prefill chunk (attention, a matmul, the gated delta recurrence; attention at exact and at
rewind.kernels.prompt_shapes' padded shapes) and for the whole chunk through Rewind's ModelRunner
on random Llama-3.2-1B-shaped (padded prompt shapes on and off) and Qwen 3.5 0.8B-shaped models,
after a 3,072-token prefix.

    PYTHONPATH=src python benchmarks/probes/new_shapes.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    mx.eval(call())
    return time.perf_counter() - started


def first_and_again(call: Callable[[], Any]) -> tuple[float, float]:
    first = timed(call)
    return first, min(timed(call) for _ in range(3))


def ptx_files() -> int:
    folder = os.environ.get("MLX_PTX_CACHE_DIR") or str(Path(tempfile.gettempdir()) / "mlx")
    return sum(1 for _ in Path(folder).rglob("*.ptx")) if Path(folder).exists() else 0


def op_rows(prefix: int, lengths: list[int]) -> list[dict[str, Any]]:
    from rewind.cache.kv import GrowingKVCache
    from rewind.kernels import cuda_gated_delta, prompt_shapes
    from rewind.kernels.shifted_conv import _shifted_sum

    dtype = mx.bfloat16
    heads, kv_heads, head_dim, hidden, ffn = 8, 2, 256, 1024, 3584
    weight = mx.random.normal((ffn, hidden)).astype(dtype)
    rows = []
    for length in lengths:
        q = mx.random.normal((1, heads, length, head_dim)).astype(dtype)
        kv = mx.random.normal((1, kv_heads, prefix + length, head_dim)).astype(dtype)
        x = mx.random.normal((1, length, hidden)).astype(dtype)
        mx.eval(q, kv, x)
        q64 = mx.random.normal((1, 32, length, 64)).astype(dtype)
        kv64 = mx.random.normal((1, 8, prefix + length, 64)).astype(dtype)
        conv_in = mx.random.normal((1, length + 3, 6144)).astype(dtype)
        conv_weight = mx.random.normal((6144, 4, 1)).astype(dtype)
        mx.eval(conv_in, conv_weight, q64, kv64)
        pieces = {
            "depthwise conv1d (linear attention's)": lambda: mx.conv1d(
                conv_in, conv_weight, groups=6144),
            "the same as shifted multiply-adds (rewind.kernels.shifted_conv)":
                lambda: _shifted_sum(conv_in, conv_weight),
            "attention (sdpa, causal)": lambda: mx.fast.scaled_dot_product_attention(
                q, kv, kv, scale=head_dim ** -0.5, mask="causal"),
            "matmul [L,1024]x[1024,3584]": lambda: x @ weight.T,
            # Llama 3.2 1B's heads (head_dim 64): cuDNN's attention on CUDA, whose plan cache
            # is keyed by the exact query and key lengths.
            "attention, 32 heads of 64 (cuDNN's on CUDA)": lambda: mx.fast.scaled_dot_product_attention(
                q64, kv64, kv64, scale=64 ** -0.5, mask="causal"),
        }
        # The same two attentions at Rewind's padded shapes (rewind.kernels.prompt_shapes): the
        # keys read to the ladder's rung of prefix + length, the queries to a multiple of 256.
        # Rewind pads only the shapes cuDNN takes (head size up to 128): the 256-wide one is
        # timed to show what padding would do on MLX's matmul path.
        padded = {}
        for label, (pq, pkv, dim) in {"attention (sdpa, causal)": (q, kv, head_dim),
                                      "attention, 32 heads of 64": (q64, kv64, 64)}.items():
            cache = GrowingKVCache()
            cache.update_and_fetch(pkv, pkv)
            mx.eval(cache.keys)
            padded[f"{label}, padded shapes"] = (
                lambda pq=pq, cache=cache, dim=dim: prompt_shapes.attention(pq, cache, dim ** -0.5))
        pieces.update(padded)
        if cuda_gated_delta.available():
            gq = mx.random.normal((1, length, 16, 128)).astype(dtype)
            gv = mx.random.normal((1, length, 16, 128)).astype(dtype)
            gate = mx.random.uniform(shape=(1, length, 16))
            beta = mx.random.uniform(shape=(1, length, 16))
            state = mx.zeros((1, 16, 128, 128), mx.float32)
            mx.eval(gq, gv, gate, beta, state)
            pieces["gated delta (CUDA kernel)"] = lambda: cuda_gated_delta.recurrence(
                gq, gq, gv, gate, beta, state)
        for name, call in pieces.items():
            before = ptx_files()
            first, again = first_and_again(call)
            rows.append({"piece": name, "length": length, "first_ms": first * 1e3,
                         "again_ms": again * 1e3, "ptx_written": ptx_files() - before})
    return rows


def model_rows(prefix: int, lengths: list[int], quick: bool) -> list[dict[str, Any]]:
    """Tail chunks of new lengths after the prefix, with the linear-attention convolution as
    loaded (shifted multiply-adds on CUDA) and as mlx-lm's nn.Conv1d; each variant gets lengths
    of its own, so both meet them first."""
    import mlx.nn as nn

    from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_model, make_prompts
    from rewind.engine.runner import ModelRunner
    from rewind.kernels.shifted_conv import ShiftedDepthwiseConv1d

    name = "qwen3.5-tiny" if quick else "qwen3.5-0.8b"
    family, overrides = {**SHAPES, **QUICK_SHAPES}[name]
    work = Path(tempfile.gettempdir()) / "rewind-probe-models"  # shared by the probes
    loaded = build_model(name, family, overrides, work)
    vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
    runner = ModelRunner(loaded.model, block_tokens=256)
    base = make_prompts(1, prefix, vocab, seed=1)[0]
    shifted = [m for _, m in loaded.model.named_modules() if type(m) is ShiftedDepthwiseConv1d]

    def after_prefix() -> Any:
        cache = runner.new_cache()
        mx.eval(runner.prefill(cache, base, 0, [], None))
        return cache

    rows = []
    variants = [("as loaded", ShiftedDepthwiseConv1d)] + ([("nn.Conv1d", nn.Conv1d)] if shifted else [])
    for index, (variant, conv_class) in enumerate(variants):
        for module in shifted:
            module.__class__ = conv_class
        for _ in range(2):  # the prefix's own chunk shapes, compiled before anything is timed
            after_prefix()
        for length in (n + index for n in lengths):
            tail = make_prompts(1, length, vocab, seed=length)[0]
            times = []
            for _ in range(3):
                cache = after_prefix()
                before = ptx_files()
                started = time.perf_counter()
                mx.eval(runner.prefill(cache, tail, prefix, [], None))
                times.append((time.perf_counter() - started, ptx_files() - before))
            rows.append({"piece": f"{name}, conv {variant} ({len(shifted)} shifted): tail chunk",
                         "length": length, "first_ms": times[0][0] * 1e3,
                         "again_ms": min(t for t, _ in times[1:]) * 1e3,
                         "ptx_written": times[0][1]})
    for module in shifted:
        module.__class__ = ShiftedDepthwiseConv1d
    cold = make_prompts(1, prefix + lengths[0], vocab, seed=99)[0]
    for label in ("cold prefill, first", "cold prefill, again"):
        cache = runner.new_cache()
        started = time.perf_counter()
        mx.eval(runner.prefill(cache, cold, 0, [], None))
        rows.append({"piece": f"{name}: {label} of {len(cold)} tokens", "length": len(cold),
                     "first_ms": (time.perf_counter() - started) * 1e3, "again_ms": None,
                     "ptx_written": None})
    return rows


def llama_rows(prefix: int, lengths: list[int], quick: bool) -> list[dict[str, Any]]:
    """Tail chunks of new lengths after the prefix on a Llama shape (head size 64: cuDNN's
    attention on CUDA), with the prompt calls' attention at padded shapes and at exact ones
    (REWIND_PROMPT_SHAPES=off); each variant gets lengths of its own."""
    from rewind import env
    from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_model, make_prompts
    from rewind.engine.runner import ModelRunner

    name = "llama-tiny" if quick else "llama-3.2-1b"
    family, overrides = {**SHAPES, **QUICK_SHAPES}[name]
    loaded = build_model(name, family, overrides, Path(tempfile.gettempdir()) / "rewind-probe-models")
    vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
    runner = ModelRunner(loaded.model, block_tokens=256)
    base = make_prompts(1, prefix, vocab, seed=1)[0]
    rows = []
    for index, setting in enumerate(("on", "off")):
        with env.overridden({env.PROMPT_SHAPES: setting}):
            def after_prefix() -> Any:
                cache = runner.new_cache()
                mx.eval(runner.prefill(cache, base, 0, [], None))
                return cache

            for _ in range(2):
                after_prefix()
            for length in (n + 2 + index for n in lengths):
                tail = make_prompts(1, length, vocab, seed=length)[0]
                times = []
                for _ in range(3):
                    cache = after_prefix()
                    started = time.perf_counter()
                    mx.eval(runner.prefill(cache, tail, prefix, [], None))
                    times.append(time.perf_counter() - started)
                rows.append({"piece": f"{name}, prompt shapes {setting}: tail chunk",
                             "length": length, "first_ms": times[0] * 1e3,
                             "again_ms": min(times[1:]) * 1e3, "ptx_written": None})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/new_shapes.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, short prefix")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prefix = 512 if args.quick else 3072
    lengths = [37, 101, 155] if args.quick else [37, 101, 155, 203, 229]
    rows = (op_rows(prefix, lengths) + llama_rows(prefix, lengths, args.quick)
            + model_rows(prefix, lengths, args.quick))
    print(f"device {mx.default_device()}, mlx {mx.__version__}, prefix {prefix}")
    print("| piece | length | first ms | again ms | PTX files written |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        again = "" if row["again_ms"] is None else f"{row['again_ms']:.1f}"
        print(f"| {row['piece']} | {row['length']} | {row['first_ms']:.1f} | {again} | "
              f"{'' if row['ptx_written'] is None else row['ptx_written']} |")
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()),
                                         "mlx": mx.__version__, "prefix": prefix, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
