"""Decode tokens/s at 1, 8 and 32 concurrent streams: Rewind's engine (what `rewind serve` runs),
`rewind serve` over HTTP, and mlx-lm's BatchGenerator on the same weights, against the
HBM-bandwidth bound, on random-weight bf16 models of real shapes (Llama-3.2-1B, Qwen 3.5 0.8B).

Why random weights: speed does not depend on the values, and the GPU machine has no registry to
fetch real ones. Each model is built with rewind.testing.tiny_models.build_tiny_model at the real
shape and loaded with Rewind's loader (bf16 on a GPU); mlx-lm runs on the same model object.

What is timed: N prompts of --prompt-tokens distinct random tokens arrive together. Rewind's
scheduler prefills them in chunks while earlier streams already decode, so a stream's tokens are
timestamped and only the window where all N streams decode counts (from the last stream's first
token to the first stream's last); each stream asks for enough tokens that the window holds
--decode-tokens steps. mlx-lm's BatchGenerator is timed over --decode-tokens steps once all N
sequences are in its generation batch.

The bound: a decode step must read every weight once (the tied embedding as the output head) and
each row's KV cache (and a linear-attention layer's recurrent state); at 4.8 TB/s that takes
(weight bytes + N x state bytes) / 4.8e12 s, so N streams cannot beat N / that tokens/s.

Per step of the engine's all-decode window, timers around the scheduler step, the runner's forward
(graph building vs evaluation) and the sampler say where a step's wall time goes; a separate
process (the developer probe benchmarks/probes/decode_kernels.py) traces the CUDA kernels for GPU
busy time and for which attention kernel a decode step takes.

This module runs the workload (options, the order of the parts, the report's JSON); each part
and reading has a module beside it: decode_scaling_models (shapes, random models, prompts),
decode_scaling_bound (the HBM bound), decode_scaling_window (the all-decoding window),
decode_scaling_engine, decode_scaling_mlx_lm, decode_scaling_http and decode_scaling_kernels
(one system each), decode_scaling_report (the Markdown page).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rewind.bench.decode_scaling_bound import hbm_bytes_per_s, hbm_card, stream_bytes
from rewind.bench.decode_scaling_engine import run_engine
from rewind.bench.decode_scaling_http import run_http, start_server
from rewind.bench.decode_scaling_kernels import run_kernel_trace
from rewind.bench.decode_scaling_llama_cpp import run_llama_cpp
from rewind.bench.decode_scaling_mlx_lm import run_mlx_lm
from rewind.bench.decode_scaling_models import (QUICK_SHAPES, SHAPES, build_model, eos_ids,
                                                make_prompts)
from rewind.bench.decode_scaling_report import markdown

RESULTS = Path("benchmarks/results")
# llama.cpp's CUDA build on the same H200, quoted from shared/GPU.md (not re-measured here):
# random Llama-3.2-1B-shaped F16 GGUF, 32k vocabulary, llama-bench / llama-batched-bench
# -npp 512 -ntg 128.
LLAMA_CPP_QUOTED = {"source": "shared/GPU.md (quoted, not re-measured)",
                    "model": "random Llama-3.2-1B-shaped GGUF, F16, 32k vocabulary",
                    "decode_tok_s": {1: 890, 8: 3689, 32: 10086}}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"shapes to run (default: all of {', '.join(SHAPES)}; --quick: "
                             f"{', '.join(QUICK_SHAPES)})")
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="decode steps in each timed window")
    parser.add_argument("--parts", nargs="+", default=["engine", "greedy", "mlx-lm", "http"],
                        choices=["engine", "uncompiled", "compiled", "fused", "unfused",
                                 "plain-blocks", "skinny", "greedy", "mlx-lm",
                                 "http", "kernels", "llama-cpp"],
                        help="engine: Rewind's Engine as served, greedy with a logit bias "
                             "against EOS; uncompiled / compiled: the same engine with "
                             "REWIND_COMPILED_DECODE off / on, each stream count after "
                             "the engines' (one process: these machines' host speed varies "
                             "between processes); fused / unfused: another engine on the same "
                             "weights loaded with REWIND_FUSED_PROJECTIONS=on / off, at each "
                             "stream count beside the first engine, the two taking turns going "
                             "first; plain-blocks: another "
                             "engine loaded with REWIND_FUSED_DECODE=off (mlx-lm's blocks for a "
                             "lone row, not rewind.kernels.cuda_block's), likewise; skinny: "
                             "another engine loaded with REWIND_SKINNY_PRODUCTS=on (a decode "
                             "batch's products in rewind.kernels.cuda_skinny, not cuBLAS), "
                             "likewise; "
                             "greedy: the same without the bias (plain argmax sampler); "
                             "mlx-lm: BatchGenerator; http: rewind serve + openai client; "
                             "kernels: the CUDA kernel trace (benchmarks/probes/decode_kernels.py); "
                             "llama-cpp: llama-batched-bench on the same weights as an F16 GGUF "
                             "(Llama shapes; needs --llama-cpp-bin)")
    parser.add_argument("--llama-cpp-bin", type=Path, default=None,
                        help="the folder holding llama.cpp's llama-batched-bench (a CUDA build "
                             "for a GPU run), for --parts llama-cpp")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, short prompts: a check that the bench runs")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip the parts not started after this many seconds (results so "
                             "far are written after every row)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the random models are written (default: a temp folder)")
    parser.add_argument("--commit", default=None, help="the commit measured, for the report")
    parser.add_argument("--json", type=Path, default=RESULTS / "decode-scaling-h200.json",
                        help="JSON output; the Markdown table goes beside it (.md)")


# ---- the run ----------------------------------------------------------------------------------


class Deadline:
    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def passed(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.started > self.seconds


def measure_model(name: str, family: str, overrides: dict[str, Any], args: argparse.Namespace,
                  work_dir: Path, deadline: Deadline, report: dict[str, Any],
                  save: Callable[[], None]) -> None:
    import mlx.core as mx

    from rewind import env
    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine
    from rewind.models.loader import describe_compute

    print(f"== {name}: building and loading ...", flush=True)
    started = time.perf_counter()
    loaded = build_model(name, family, overrides, work_dir)
    build_s = time.perf_counter() - started
    sizes = stream_bytes(loaded)
    vocab = int(loaded.config.get("vocab_size") or overrides.get("vocab_size"))
    bias = {t: -100.0 for t in eos_ids(loaded)}
    entry: dict[str, Any] = {
        "family": family, "config_overrides": overrides, "build_and_load_s": round(build_s, 1),
        "compute": describe_compute(loaded.model), "bytes": asdict(sizes),
        "eos_bias": {str(k): v for k, v in bias.items()}, "rows": {}}
    report["models"][name] = entry
    streams = sorted(set(args.streams))

    def started_engine(model: Any) -> Any:
        """An Engine serving `model` as the bench's every engine is configured, running."""
        served = Engine(model, EngineConfig(parallel=max(streams), max_queue=4 * max(streams)),
                        prompt_cache=PromptCache(model.model, model.fingerprint, CacheConfig()))
        served.start()
        return served

    engine = started_engine(loaded)
    chunk_tokens = engine.runner.chunk_tokens
    seed = 0
    # the same folder loaded again with the sibling projections fused or not, whatever the
    # served default is (rewind.models.fused_projections); started inside the try below
    projections: dict[str, Any] = {}
    order: list[tuple[str, Any]] = []
    other_engine = None

    def prompts(count: int, length: int | None = None) -> list[list[int]]:
        nonlocal seed
        seed += 1
        return make_prompts(count, length or args.prompt_tokens, vocab, seed)

    def record(part: str, count: int, result: dict[str, Any]) -> None:
        context = result.get("mean_context", args.prompt_tokens + args.decode_tokens / 2)
        if "tok_s" in result:
            bound = sizes.bound_tok_s(count, context, report["hbm_bytes_per_s"])
            result["bound_tok_s"] = round(bound, 1)
            result["of_bound"] = round(result["tok_s"] / bound, 3)
        entry["rows"].setdefault(str(count), {})[part] = result
        print(f"   {part:<8} N={count:<3} {json.dumps(result)}", flush=True)
        save()

    try:
        for part, variable, setting in (("fused", env.FUSED_PROJECTIONS, "on"),
                                        ("unfused", env.FUSED_PROJECTIONS, "off"),
                                        ("plain-blocks", env.FUSED_DECODE, "off"),
                                        ("skinny", env.SKINNY_PRODUCTS, "on")):
            if part in args.parts:
                with env.overridden({variable: setting}):
                    other = build_model(name, family, overrides, work_dir)
                entry[f"compute_{part}"] = describe_compute(other.model)
                projections[part] = started_engine(other)
                del other
        # Warm-up: every batch size's kernels compiled (and cuDNN graphs built) before timing;
        # at each stream count, since MLX names a fused kernel by its inputs' kinds, and one row
        # makes some of them scalars (new kernels to build).
        warm = max(streams)
        compiled_parts = {"uncompiled": "off", "compiled": "on"}
        if {"engine", "greedy", *compiled_parts, *projections} & set(args.parts):
            for count in streams:  # as served (compiled on CUDA): each count's shapes
                run_engine(engine, prompts(count, 64), 8, chunk_tokens, bias)
            for part, setting in compiled_parts.items():
                if part in args.parts:
                    with env.overridden({env.COMPILED_DECODE: setting}):
                        for count in streams:
                            run_engine(engine, prompts(count, 64), 8, chunk_tokens, bias)
            for other_engine in projections.values():
                for count in streams:
                    run_engine(other_engine, prompts(count, 64), 8, chunk_tokens, bias)
            # the attention kernel's spans (contexts past one span), as the server's warm-up
            from rewind.kernels import cuda_attention
            cuda_attention.warm_kernels()
        if "mlx-lm" in args.parts:
            with env.overridden({env.GATED_DELTA: "off", env.CUDA_ATTENTION: "off"}):
                run_mlx_lm(loaded.model, prompts(warm, 64), 8)
        for index, count in enumerate(streams):
            # the engines take turns going first from one stream count to the next, the served
            # one among them (the order within a process has moved a step's time as much as
            # the change compared did)
            order = [("engine", engine)] if "engine" in args.parts else []
            order += list(projections.items())
            for part, each_engine in (order[::-1] if index % 2 else order):
                if not deadline.passed():
                    record(part, count, run_engine(each_engine, prompts(count),
                                                   args.decode_tokens, chunk_tokens, bias))
            for part, setting in compiled_parts.items():
                if part in args.parts and not deadline.passed():
                    with env.overridden({env.COMPILED_DECODE: setting}):
                        record(part, count, run_engine(engine, prompts(count),
                                                       args.decode_tokens, chunk_tokens, bias))
            if "greedy" in args.parts and not deadline.passed():
                record("greedy", count,
                       run_engine(engine, prompts(count), args.decode_tokens, chunk_tokens, None))
            if "mlx-lm" in args.parts and not deadline.passed():
                # mlx-lm as shipped: Rewind's gated delta and decode attention kernels
                # (installed on the model's modules by the loader) step aside while it runs.
                with env.overridden({env.GATED_DELTA: "off", env.CUDA_ATTENTION: "off"}):
                    record("mlx-lm", count,
                           run_mlx_lm(loaded.model, prompts(count), args.decode_tokens))
            mx.clear_cache()
        entry["engine_stats"] = {k: v for k, v in engine.stats().items()
                                 if k in ("generated_tokens", "prefilled_tokens",
                                          "cached_tokens", "mlx_peak_bytes", "steps",
                                          "pipelined_steps", "compiled_decode_steps",
                                          "compiled_decode_traces")}
    finally:
        engine.shutdown()
        for other_engine in projections.values():
            other_engine.shutdown()
        # their models and caches off the GPU before the parts below
        projections.clear()
        order, other_engine = [], None
    folder = loaded.path
    del engine, loaded
    mx.clear_cache()

    if "kernels" in args.parts and not deadline.passed():
        print(f"== {name}: CUDA kernel trace ...", flush=True)
        out = work_dir / f"{name}-kernels.json"
        entry["kernels"] = run_kernel_trace(
            folder, out, [streams[0], streams[-1]], args.prompt_tokens,
            attention_cases=family == "llama", timeout=300)
        save()

    if "http" in args.parts and not deadline.passed():
        print(f"== {name}: rewind serve over HTTP ...", flush=True)
        server = None
        try:
            server = start_server(folder, max(streams), work_dir)
            entry["http_server"] = {"command": server.command,
                                    "ready_s": round(server.ready_seconds, 1)}
            run_http(server, prompts(max(streams), 64), 8, chunk_tokens, bias)  # warm-up
            for count in streams:
                if deadline.passed():
                    break
                record("http", count,
                       run_http(server, prompts(count), args.decode_tokens, chunk_tokens, bias))
        except Exception as exc:  # the in-process rows stand without it
            entry["http_error"] = f"{type(exc).__name__}: {exc}"
            if server is not None:
                entry["http_log_tail"] = server.log_tail()
            print(f"   http failed: {entry['http_error']}", flush=True)
        finally:
            if server is not None:
                server.stop()

    if "llama-cpp" in args.parts and family == "llama" and not deadline.passed():
        print(f"== {name}: llama.cpp's llama-batched-bench on an F16 GGUF ...", flush=True)
        try:
            llama = run_llama_cpp(folder, args.llama_cpp_bin, work_dir, args.prompt_tokens,
                                  args.decode_tokens, streams)
        except Exception as exc:  # Rewind's rows stand without it
            llama = {"command": "(not run)", "version": "-",
                     "error": f"{type(exc).__name__}: {exc}"}
        for count, row in llama.pop("rows", {}).items():
            record("llama.cpp", count, row)
        entry["llama_cpp"] = llama
        save()


def run(args: argparse.Namespace) -> int:
    from rewind.bench.machine import command_line, machine_info, nvidia_gpu

    if args.quick:
        args.models = args.models or list(QUICK_SHAPES)
        args.streams = [1, 3]
        args.prompt_tokens, args.decode_tokens = 80, 6
    shapes = {**SHAPES, **QUICK_SHAPES}
    names = args.models or list(SHAPES)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"unknown model shape(s) {unknown}; known: {', '.join(shapes)}")
    if "llama-cpp" in args.parts and not (
            args.llama_cpp_bin and (args.llama_cpp_bin / "llama-batched-bench").exists()):
        raise SystemExit("--parts llama-cpp needs --llama-cpp-bin DIR holding llama-batched-bench")
    deadline = Deadline(args.deadline_s)
    card = nvidia_gpu()
    gpu = card["name"] if card else None
    report: dict[str, Any] = {
        "command": command_line(), "commit": args.commit, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "gpu": gpu, "hbm_card": hbm_card(gpu), "hbm_bytes_per_s": hbm_bytes_per_s(gpu),
        "llama_cpp_quoted": LLAMA_CPP_QUOTED,
        "models": {}}

    def save() -> None:
        report["machine"] = machine_info()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        args.json.with_suffix(".md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="rewind-decode-scaling-") as scratch:
        work_dir = args.work_dir or Path(scratch)
        work_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            if deadline.passed():
                break
            family, overrides = shapes[name]
            measure_model(name, family, overrides, args, work_dir, deadline, report, save)
    save()
    print(markdown(report))
    print(f"wrote {args.json} and {args.json.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    register(parser)
    sys.exit(run(parser.parse_args()))
