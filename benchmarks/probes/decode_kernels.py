"""Which CUDA kernels a decode step runs, and how busy they keep the GPU: run in a process of its
own by `rewind bench decode-scaling` (parts `kernels`), or from the repository root as
`PYTHONPATH=src python benchmarks/probes/decode_kernels.py --model FOLDER --json OUT`.

Why torch: MLX has no kernel timeline on CUDA; PyTorch's profiler records every kernel of the
process through CUPTI, MLX's included (rewind.bench.cupti_trace). Two uses:

- attention path: MLX's CUDA attention takes cuDNN's fused kernel for a one-token query only when
  the KV is a slice of one buffer whose capacity is a multiple of 256 and there is no array mask
  (`use_cudnn_for_decoding` in mlx/backend/cuda/scaled_dot_product_attention.cpp), else its own
  vector kernel (`kernel_sdpav_*`) where the head size allows and there is no array mask, else
  the unfused fallback (matmuls + softmax). The kernel names of one traced decode step say which
  ran, for a fresh cache, a deliberately non-conforming one, a cache restored from the prompt
  cache, and merged batches (mlx-lm's batch caches always pass an array mask).
- GPU busy time per decode step (the union of kernel intervals) against the step's wall time:
  where it is far below, the step waits on the host (Python, graph building, launches), not HBM.

Without torch (the CPU, or a machine without it) the step timings and KV shapes are still
written; the kernel fields say why they are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewind.bench.cupti_trace import (  # torch before mlx
    PROFILE, busy_us, top_kernels, traced)

# Names as the CUDA libraries and MLX give them (substrings, lower case).
CUDNN_MARKS = ("cudnn", "fmha", "flash", "sdpa_")
MLX_VECTOR_MARK = "sdpav"


def attention_path(kernels: list[dict[str, Any]] | None) -> str:
    if kernels is None:
        return "unknown (no kernel profiler in this process)"
    names = [k["name"].lower() for k in kernels]
    if any(MLX_VECTOR_MARK in n for n in names):
        return "MLX sdpa_vector kernel"
    if any(mark in n for n in names for mark in CUDNN_MARKS):
        return "cuDNN fused attention"
    if any("softmax" in n for n in names):
        return "unfused fallback (matmul + softmax)"
    return "none recognised"


def attention_kernel_names(kernels: list[dict[str, Any]] | None) -> list[str]:
    if not kernels:
        return []
    marks = (*CUDNN_MARKS, MLX_VECTOR_MARK, "softmax", "attention")
    return sorted({k["name"][:120] for k in kernels
                   if any(m in k["name"].lower() for m in marks)})


def vocab_size(loaded: Any) -> int:
    config = loaded.config
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def prompt_ids(seed: int, length: int, vocab: int) -> list[int]:
    """Distinct pseudo-random ids above the tiny tokenizer's special tokens, one list a seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(16, vocab) for _ in range(length)]


def marker(name: str) -> None:
    """A one-thread kernel named marker_<name>: under Nsight Compute (when torch's profiler is
    not at hand) it separates a case's traced decode step from the prefill before it."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu or not hasattr(mx.fast, "cuda_kernel"):
        return
    kernel = mx.fast.cuda_kernel(name=f"marker_{name}", input_names=["x"], output_names=["y"],
                                 source="y[0] = x[0];")
    out = kernel(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                 output_shapes=[(1,)], output_dtypes=[mx.float32])
    mx.eval(out)


# ---- attention cases --------------------------------------------------------------------------


def _kv_buffer(cache: list[Any]) -> str:
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if keys is not None:
            held = getattr(layer, "_idx", None)
            held = held if held is not None else layer.offset
            return f"{keys.shape[2]} / {held} (batch {keys.shape[0]})"
    return "-"


def attention_cases(loaded: Any, prompt_tokens: int,
                    only: int | None = None) -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig
    from rewind.engine.runner import ModelRunner, Segment

    runner = ModelRunner(loaded.model)
    vocab = vocab_size(loaded)
    base = prompt_ids(0, prompt_tokens, vocab)

    def prefilled(length: int, offset: int = 0) -> list[Any]:
        cache = runner.new_cache()
        runner.prefill(cache, prompt_ids(offset, length, vocab), logits=False)
        return cache

    def non_conforming(length: int) -> list[Any]:
        """A cache whose buffer is exactly the tokens held: the next step grows it by 256 to a
        capacity that is not a multiple of 256."""
        cache = prefilled(length)
        out = []
        for layer in cache:
            copy = KVCache()
            copy.keys = mx.contiguous(layer.keys[..., :layer.offset, :])
            copy.values = mx.contiguous(layer.values[..., :layer.offset, :])
            copy.offset = layer.offset
            out.append(copy)
        mx.eval([[c.keys, c.values] for c in out])
        return out

    def restored() -> list[Any]:
        store = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(disk_enabled=False))
        tokens = base[:prompt_tokens]
        cache = runner.new_cache()
        runner.prefill(cache, tokens, logits=False,
                       on_checkpoint=lambda end, c: store.checkpoint(tokens[:end], c))
        got = store.restore(tokens)
        if got.tokens == 0:
            raise RuntimeError("the prompt cache restored nothing")
        runner.prefill(got.cache, tokens[got.tokens:], start=got.tokens, logits=False)
        return got.cache

    def merged(lengths: list[int]) -> list[Any]:
        batch = None
        for i, length in enumerate(lengths):
            batch = runner.join(batch, prefilled(length, offset=i))
        return batch or []

    def restored_merged() -> list[Any]:
        return runner.join(None, restored())

    length = prompt_tokens
    odd = prompt_tokens - 24  # not a multiple of 256
    cases: list[tuple[str, Callable[[], list[Any]]]] = [
        (f"one sequence, fresh cache ({length} tokens)", lambda: prefilled(length)),
        (f"one sequence, fresh cache ({odd} tokens)", lambda: prefilled(odd)),
        (f"one sequence, exact-size buffer ({odd} tokens; deliberately non-conforming)",
         lambda: non_conforming(odd)),
        (f"one sequence, restored from the prompt cache ({length} tokens)", restored),
        (f"merged batch of 1 (runner.join; the engine's decode batch at N=1, {length} tokens)",
         lambda: merged([length])),
        ("merged batch of 1, restored from the prompt cache", restored_merged),
        (f"merged batch of 4 ({length}, {odd}, {length // 2}, {length} tokens)",
         lambda: merged([length, odd, length // 2, length])),
    ]
    results = []
    for index, (name, make) in enumerate(cases):
        if only is not None and index != only:
            continue
        try:
            cache = make()
            rows = cache[0].keys.shape[0] if getattr(cache[0], "keys", None) is not None else 1

            def step() -> None:
                tokens = mx.array([[100 + r] for r in range(rows)])
                runner.forward([Segment(tokens, cache, logits=True)])

            for _ in range(2):  # the step that grows the buffer, and cuDNN's graph build
                step()
            shape = _kv_buffer(cache)
            marker(f"case{index}")
            kernels = traced(step)
            marker(f"case{index}_end")
            times = []
            for _ in range(15):
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
            results.append({"case": name, "kv_buffer": shape,
                            "attention": attention_path(kernels),
                            "attention_kernels": attention_kernel_names(kernels),
                            "step_ms": round(1000 * statistics.median(times), 3),
                            "gpu_busy_ms": (round(busy_us(kernels) / 1000, 3)
                                            if kernels else None),
                            "kernels": len(kernels) if kernels is not None else None})
        except Exception as exc:  # one failing case must not hide the others
            results.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(results[-1]), flush=True)
        mx.clear_cache()
    return results


# ---- GPU busy time of the engine's and mlx-lm's decode steps ----------------------------------


def engine_busy(loaded: Any, streams: int, prompt_tokens: int, steps: int) -> dict[str, Any]:
    """Trace `steps` decode steps of the engine (as `rewind serve` runs it) with all `streams`
    decoding."""
    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine, GenerationRequest, SamplingParams

    engine = Engine(loaded, EngineConfig(parallel=streams, max_queue=streams),
                    prompt_cache=PromptCache(loaded.model, loaded.fingerprint, CacheConfig())).start()
    try:
        bias = {t: -100.0 for t in sorted(engine.eos_token_ids)}
        handles = [engine.submit(GenerationRequest(
            prompt_tokens=prompt_ids(i + 1, prompt_tokens, vocab_size(loaded)),
            params=SamplingParams(temperature=0.0, max_tokens=100_000, logit_bias=bias)))
            for i in range(streams)]
        drains = [threading.Thread(target=lambda h=h: h.collect(), daemon=True)
                  for h in handles]
        for thread in drains:
            thread.start()
        deadline = time.monotonic() + 120
        while engine.stats()["decoding"] < streams and time.monotonic() < deadline:
            time.sleep(0.005)
        for _ in range(5):  # a few steps at the full batch before the trace
            _wait_tokens(engine, streams)
        counted: dict[str, float] = {}

        def run() -> None:
            before = engine.stats()["generated_tokens"]
            started = time.perf_counter()
            _wait_tokens(engine, streams * steps)
            counted["seconds"] = time.perf_counter() - started
            counted["tokens"] = engine.stats()["generated_tokens"] - before

        kernels = traced(run)
        for handle in handles:
            handle.cancel()
    finally:
        engine.shutdown()
    done_steps = counted["tokens"] / streams
    return _busy_row("Rewind engine", streams, done_steps, counted["seconds"], kernels)


def _wait_tokens(engine: Any, tokens: int) -> None:
    target = engine.stats()["generated_tokens"] + tokens
    while engine.stats()["generated_tokens"] < target:
        time.sleep(0.0005)


def mlx_lm_busy(loaded: Any, streams: int, prompt_tokens: int, steps: int) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator

    from rewind.kernels.gated_delta import ENV

    os.environ[ENV] = "off"  # mlx-lm as shipped
    generator = BatchGenerator(loaded.model, max_tokens=100_000,
                               completion_batch_size=max(32, streams))
    try:
        generator.insert([prompt_ids(i + 1, prompt_tokens, vocab_size(loaded))
                          for i in range(streams)])
        seen: set[int] = set()
        while len(seen) < streams:
            seen.update(r.uid for r in generator.next_generated())
        for _ in range(5):
            generator.next_generated()
        counted: dict[str, float] = {}

        def run() -> None:
            started = time.perf_counter()
            for _ in range(steps):
                generator.next_generated()
            counted["seconds"] = time.perf_counter() - started

        kernels = traced(run)
    finally:
        generator.close()
        os.environ.pop(ENV, None)
    return _busy_row("mlx-lm BatchGenerator", streams, steps, counted["seconds"], kernels)


def _busy_row(path: str, streams: int, steps: float, seconds: float,
              kernels: list[dict[str, Any]] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"path": path, "streams": streams, "steps": round(steps, 1),
                           "wall_ms_per_step": round(1000 * seconds / steps, 3)}
    if kernels:
        row["gpu_busy_ms_per_step"] = round(busy_us(kernels) / steps / 1000, 3)
        row["kernels_per_step"] = round(len(kernels) / steps, 1)
        row["top_kernels"] = top_kernels(kernels, max(1, round(steps)))
        row["attention"] = attention_path(kernels)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/decode_kernels.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--json", required=True, type=Path)
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="decode steps traced per row")
    parser.add_argument("--no-attention-cases", action="store_true")
    parser.add_argument("--only-case", type=int, default=None,
                        help="run this attention case alone and no busy-time rows (for ncu)")
    args = parser.parse_args(argv)

    import mlx.core as mx

    from rewind.models.loader import load_model

    loaded = load_model(str(args.model))
    report: dict[str, Any] = {
        "device": str(mx.default_device()),
        "profiler": "torch.profiler (CUPTI)" if PROFILE is not None else None,
        "note": None if PROFILE is not None else
        "no CUDA torch in this process: kernel names and GPU busy time not recorded"}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")

    if not args.no_attention_cases:
        report["attention_cases"] = attention_cases(loaded, args.prompt_tokens, args.only_case)
        report["profiler_saw_kernels"] = any(c.get("kernels") for c in report["attention_cases"])
        save()
    if args.only_case is not None:
        return 0
    report["gpu_busy"] = []
    for streams in args.streams:
        for measure in (engine_busy, mlx_lm_busy):
            try:
                report["gpu_busy"].append(measure(loaded, streams, args.prompt_tokens,
                                                  args.steps))
            except Exception as exc:
                report["gpu_busy"].append({"path": measure.__name__, "streams": streams,
                                           "error": f"{type(exc).__name__}: {exc}"})
            save()
            mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
