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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path("benchmarks/results")
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; a read probe there reached 4.58e12 (shared/GPU.md)

# Real shapes. Llama-3.2-1B's config (rope scaling left out: it changes a constant, not the work).
LLAMA_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
            "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0,
            "max_position_embeddings": 131072}
# Qwen 3.5 0.8B: benchmarks/probes/gated_delta.py's MODEL_SIZES["0.8b"] with the real 248,320-word
# tied vocabulary (that probe cut it to 32k; here the head is a third of the bytes read per step).
QWEN35_08B = {"hidden_size": 1024, "num_hidden_layers": 24, "full_attention_interval": 4,
              "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 256, "linear_num_value_heads": 16, "linear_num_key_heads": 16,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "vocab_size": 248320, "tie_word_embeddings": True,
              "max_position_embeddings": 262144}
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("llama", LLAMA_1B),
    "qwen3.5-0.8b": ("qwen3_5", QWEN35_08B),
}
# --quick: the tiny test shapes (vocabulary widened so random ids are not all special tokens).
QUICK_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("llama", {"vocab_size": 4096, "tie_word_embeddings": True}),
    "qwen3.5-tiny": ("qwen3_5", {"vocab_size": 4096, "tie_word_embeddings": True}),
}
# llama.cpp's CUDA build on the same H200, quoted from shared/GPU.md (not re-measured here):
# random Llama-3.2-1B-shaped F16 GGUF, 32k vocabulary, llama-bench / llama-batched-bench
# -npp 512 -ntg 128.
LLAMA_CPP_QUOTED = {"source": "shared/GPU.md (quoted, not re-measured)",
                    "model": "random Llama-3.2-1B-shaped GGUF, F16, 32k vocabulary",
                    "decode_tok_s": {1: 890, 8: 3689, 32: 10086}}
FIRST_FREE_ID = 16  # prompt ids above the tiny tokenizer's special tokens


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"shapes to run (default: all of {', '.join(SHAPES)}; --quick: "
                             f"{', '.join(QUICK_SHAPES)})")
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="decode steps in each timed window")
    parser.add_argument("--parts", nargs="+", default=["engine", "greedy", "mlx-lm", "http"],
                        choices=["engine", "greedy", "mlx-lm", "http", "kernels"],
                        help="engine: Rewind's Engine, greedy with a logit bias against EOS; "
                             "greedy: the same without the bias (plain argmax sampler); "
                             "mlx-lm: BatchGenerator; http: rewind serve + openai client; "
                             "kernels: the CUDA kernel trace (benchmarks/probes/decode_kernels.py)")
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


# ---- models -----------------------------------------------------------------------------------


def build_model(name: str, family: str, overrides: dict[str, Any], work_dir: Path) -> Any:
    """A random-weight model folder of this shape, loaded by Rewind's loader (bf16 on a GPU)."""
    from rewind.models.loader import load_model
    from rewind.testing.tiny_models import build_tiny_model

    folder = work_dir / name
    if not (folder / "config.json").exists():
        build_tiny_model(family, folder, overrides=overrides)
    return load_model(str(folder))


@dataclass
class StreamBytes:
    """Bytes a decode step reads: every weight once, plus per row its cache state."""

    weight_bytes: int
    kv_bytes_per_token: int  # per row, per token held (full-attention layers' K and V)
    fixed_state_bytes: int  # per row, whatever the length (linear-attention conv + recurrent)

    def step_bytes(self, rows: int, context: float) -> float:
        return self.weight_bytes + rows * (self.kv_bytes_per_token * context
                                           + self.fixed_state_bytes)

    def bound_tok_s(self, rows: int, context: float) -> float:
        return rows / (self.step_bytes(rows, context) / HBM_BYTES_PER_S)


def stream_bytes(loaded: Any) -> StreamBytes:
    """Weight bytes read per step (an untied input embedding is a lookup of one row per token,
    so it is left out; a tied one is the output head and counts) and the cache bytes per row,
    measured on a real cache after a short prefill."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from rewind.engine.runner import ModelRunner

    params = tree_flatten(loaded.model.parameters())
    total = sum(value.nbytes for _, value in params)
    tied = not any("lm_head" in name for name, _ in params)
    embedding = sum(value.nbytes for name, value in params if "embed_tokens" in name)
    weights = total if tied else total - embedding

    runner = ModelRunner(loaded.model)
    cache = runner.new_cache()
    length = 16
    runner.prefill(cache, list(range(FIRST_FREE_ID, FIRST_FREE_ID + length)))
    per_token = fixed = 0
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if keys is not None and hasattr(layer, "offset"):
            values = layer.values
            per_token += (keys.shape[1] * keys.shape[3] * keys.dtype.size
                          + values.shape[1] * values.shape[3] * values.dtype.size)
        else:
            fixed += sum(a.nbytes for a in layer.state if isinstance(a, mx.array))
    return StreamBytes(int(weights), int(per_token), int(fixed))


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (a new seed per run, so the prompt cache never shares them)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_FREE_ID, vocab) for _ in range(length)] for _ in range(count)]


# ---- windows ----------------------------------------------------------------------------------


@dataclass
class Window:
    """The span where every stream decodes: after the last stream's first token, up to the
    first stream's last."""

    seconds: float
    tokens: int  # tokens of all streams stamped inside it
    mean_context: float  # tokens held per stream at its middle (prompt + generated)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def all_decoding_window(stamps: list[list[float]], prompt_tokens: int) -> Window:
    start = max(times[0] for times in stamps)
    end = min(times[-1] for times in stamps)
    tokens = sum(sum(1 for t in times if start < t <= end) for times in stamps)
    middle = (start + end) / 2
    held = [prompt_tokens + sum(1 for t in times if t <= middle) for times in stamps]
    return Window(end - start, tokens, sum(held) / len(held))


def stagger_tokens(streams: int, prompt_tokens: int, chunk_tokens: int) -> int:
    """Steps before the last of `streams` prompts arriving together can decode: the scheduler
    runs at least one prompt chunk per step, so at most this many."""
    return streams * math.ceil(prompt_tokens / chunk_tokens) + 8


# ---- Rewind's engine, with timers -------------------------------------------------------------


class StepTimers:
    """The engine's three step calls timed through its step listener (Engine.add_step_listener:
    schedule, run, postprocess), without touching what they do. Engine thread only records;
    read after the run."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        # (plan's decode rows, its prompt calls, its StepTiming) per step
        self.records: list[tuple[int, int, Any]] = []

    def _record(self, plan: Any, timing: Any) -> None:
        self.records.append((plan.decode_rows, len(plan.prefill), timing))

    def __enter__(self) -> StepTimers:
        self.engine.add_step_listener(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.remove_step_listener(self._record)

    def breakdown(self, start: float, end: float, rows: int) -> dict[str, Any]:
        """Mean milliseconds per pure decode step of all `rows` inside [start, end]."""
        steps = [t for decode_rows, calls, t in self.records
                 if t.started >= start and t.ended <= end and decode_rows == rows and not calls]
        if not steps:
            return {"steps": 0}
        count = len(steps)

        def mean_ms(values: list[float]) -> float:
            return round(sum(values) / count, 3)

        # Steps follow one another on the engine thread: what lies between two is the loop
        # itself (wake-ups) and the events handed to the callers.
        gaps = [b.started - a.ended for a, b in zip(steps, steps[1:])
                if b.started - a.ended < 0.5]
        return {"steps": count, "step_ms": mean_ms([t.total_ms for t in steps]),
                "schedule_ms": mean_ms([t.schedule_ms for t in steps]),
                "run_ms": mean_ms([t.run_ms for t in steps]),
                "postprocess_ms": mean_ms([t.postprocess_ms for t in steps]),
                "between_steps_ms": round(1000 * sum(gaps) / len(gaps), 3) if gaps else None}


def run_engine(engine: Any, prompts: list[list[int]], decode_tokens: int, chunk_tokens: int,
               eos_bias: dict[int, float] | None) -> dict[str, Any]:
    """All prompts at once through the engine; token stamps taken where the server takes them
    (an asyncio consumer of each handle, as the HTTP routes consume them)."""
    from rewind.engine import FinishEvent, GenerationRequest, SamplingParams

    streams, prompt_tokens = len(prompts), len(prompts[0])
    max_tokens = decode_tokens + stagger_tokens(streams, prompt_tokens, chunk_tokens)
    stamps: list[list[float]] = [[] for _ in prompts]
    reasons: dict[str, int] = {}

    async def consume(index: int, handle: Any) -> None:
        async for event in handle:
            if isinstance(event, FinishEvent):
                reasons[event.reason] = reasons.get(event.reason, 0) + 1
            else:
                stamps[index].append(time.perf_counter())

    async def main() -> None:
        handles = [engine.submit(GenerationRequest(
            prompt_tokens=prompt,
            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, logit_bias=eos_bias)))
            for prompt in prompts]
        await asyncio.gather(*(consume(i, h) for i, h in enumerate(handles)))

    with StepTimers(engine) as timers:
        started = time.perf_counter()
        asyncio.run(main())
        total = time.perf_counter() - started
    window = all_decoding_window(stamps, prompt_tokens)
    window.finish_reasons = reasons
    end_of_window = min(times[-1] for times in stamps)
    start_of_window = max(times[0] for times in stamps)
    return {"tok_s": round(window.tok_s, 1), "window_s": round(window.seconds, 3),
            "window_tokens": window.tokens, "mean_context": round(window.mean_context, 1),
            "max_tokens": max_tokens, "total_s": round(total, 2), "finish_reasons": reasons,
            "per_step": timers.breakdown(start_of_window, end_of_window, streams)}


# ---- mlx-lm's BatchGenerator ------------------------------------------------------------------


def run_mlx_lm(model: Any, prompts: list[list[int]], decode_tokens: int) -> dict[str, Any]:
    """mlx-lm's continuous batching on the same model object: greedy, no stop tokens (its way
    of never stopping at EOS), default prefill/completion batch sizes but room for every row."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    streams, prompt_tokens = len(prompts), len(prompts[0])
    generator = BatchGenerator(model, max_tokens=decode_tokens * 4 + 1024,
                               completion_batch_size=max(32, streams))
    try:
        uids = generator.insert(prompts)
        seen: set[int] = set()
        warm_steps = 0
        started = time.perf_counter()
        while len(seen) < streams:  # prefill, and decode steps of the rows already in
            for response in generator.next_generated():
                seen.add(response.uid)
            warm_steps += 1
        prefill_s = time.perf_counter() - started
        tokens = 0
        started = time.perf_counter()
        for _ in range(decode_tokens):
            tokens += len(generator.next_generated())
        seconds = time.perf_counter() - started
        generator.remove(uids)
    finally:
        generator.close()
        del generator
        mx.clear_cache()
    context = prompt_tokens + warm_steps + decode_tokens / 2
    return {"tok_s": round(tokens / seconds, 1), "window_s": round(seconds, 3),
            "window_tokens": tokens, "mean_context": round(context, 1),
            "prefill_s": round(prefill_s, 2), "step_ms": round(1000 * seconds / decode_tokens, 3)}


# ---- rewind serve over HTTP -------------------------------------------------------------------


def start_server(folder: Path, parallel: int, log_dir: Path) -> Any:
    from rewind.bench.harness import LOOPBACK, ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", str(folder), "--host", LOOPBACK,
            "--port", str(port), "--parallel", str(parallel), "--log-level", "warning"]
    # Requests name the folder as served: `default` (and /v1/models' first entry) is the
    # built-in default model, not this one.
    server = ServerProcess("rewind", argv, port, log_dir / f"rewind-serve-{port}.log",
                           ready_paths=("/health",), model_id=str(folder))
    server.start()
    server.wait_ready(timeout=600)
    return server


def run_http(server: Any, prompts: list[list[int]], decode_tokens: int, chunk_tokens: int,
             eos_bias: dict[int, float]) -> dict[str, Any]:
    """N concurrent streamed /v1/completions (token-id prompts) with the openai client, one
    thread each; a stream's token stamps are its SSE chunks with text (one per token here: the
    random ids decode to text)."""
    from openai import OpenAI

    streams, prompt_tokens = len(prompts), len(prompts[0])
    # Twice the engine's margin: requests reach the server over a few milliseconds, not at once.
    max_tokens = decode_tokens + 2 * stagger_tokens(streams, prompt_tokens, chunk_tokens) + 32
    stamps: list[list[float]] = [[] for _ in prompts]
    completion_tokens: list[int | None] = [None] * streams
    reasons: dict[str, int] = {}
    errors: list[str] = []
    barrier = threading.Barrier(streams)

    def one(index: int) -> None:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="bench", timeout=600,
                        max_retries=0)
        try:
            barrier.wait()
            stream = client.completions.create(
                model=server.model_id or "default", prompt=prompts[index],
                max_tokens=max_tokens, temperature=0.0, stream=True,
                logit_bias={str(t): v for t, v in eos_bias.items()},
                stream_options={"include_usage": True})
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    stamps[index].append(now)
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
                    reasons[reason] = reasons.get(reason, 0) + 1
                if chunk.usage is not None:
                    completion_tokens[index] = chunk.usage.completion_tokens
        except Exception as exc:  # reported, not raised: the other streams' figures still count
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = time.perf_counter() - started
    if errors or not all(stamps):
        return {"error": errors[0] if errors else "a stream sent no text"}
    window = all_decoding_window(stamps, prompt_tokens)
    if window.tokens == 0:
        return {"error": "no span where every stream decoded (requests arrived too far apart)"}
    return {"tok_s": round(window.tok_s, 1), "window_s": round(window.seconds, 3),
            "window_tokens": window.tokens, "mean_context": round(window.mean_context, 1),
            "max_tokens": max_tokens, "total_s": round(total, 2), "finish_reasons": reasons,
            "chunks": sum(len(s) for s in stamps),
            "completion_tokens": sum(t or 0 for t in completion_tokens)}


# ---- the kernel trace (its own process) -------------------------------------------------------


# A developer probe outside the installed package: found in a checkout only.
KERNEL_PROBE = Path(__file__).resolve().parents[3] / "benchmarks" / "probes" / "decode_kernels.py"


def run_kernel_trace(folder: Path, out: Path, streams: list[int], prompt_tokens: int,
                     attention_cases: bool, timeout: float) -> dict[str, Any]:
    if not KERNEL_PROBE.exists():
        return {"error": f"no kernel probe at {KERNEL_PROBE} (it runs from a checkout)"}
    argv = [sys.executable, str(KERNEL_PROBE), "--model", str(folder),
            "--json", str(out), "--streams", *map(str, streams),
            "--prompt-tokens", str(prompt_tokens)]
    if not attention_cases:
        argv.append("--no-attention-cases")
    # The probe imports rewind: the same one as this process, installed or not.
    import rewind

    src = str(Path(rewind.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else "")}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"exit {done.returncode}", "log_tail": done.stderr[-3000:]}
    return json.loads(out.read_text())


# ---- the run ----------------------------------------------------------------------------------


def eos_ids(loaded: Any) -> list[int]:
    from rewind.engine.engine import _eos_token_ids

    return sorted(_eos_token_ids(loaded.tokenizer, loaded.config))


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

    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine
    from rewind.kernels.gated_delta import ENV as GATED_DELTA_ENV
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
    engine = Engine(loaded, EngineConfig(parallel=max(streams), max_queue=4 * max(streams)),
                    prompt_cache=PromptCache(loaded.model, loaded.fingerprint, CacheConfig()))
    engine.start()
    chunk_tokens = engine.runner.chunk_tokens
    seed = 0

    def prompts(count: int, length: int | None = None) -> list[list[int]]:
        nonlocal seed
        seed += 1
        return make_prompts(count, length or args.prompt_tokens, vocab, seed)

    def record(part: str, count: int, result: dict[str, Any]) -> None:
        context = result.get("mean_context", args.prompt_tokens + args.decode_tokens / 2)
        if "tok_s" in result:
            bound = sizes.bound_tok_s(count, context)
            result["bound_tok_s"] = round(bound, 1)
            result["of_bound"] = round(result["tok_s"] / bound, 3)
        entry["rows"].setdefault(str(count), {})[part] = result
        print(f"   {part:<8} N={count:<3} {json.dumps(result)}", flush=True)
        save()

    try:
        # Warm-up: every batch size's kernels compiled (and cuDNN graphs built) before timing.
        warm = max(streams)
        if {"engine", "greedy"} & set(args.parts):
            run_engine(engine, prompts(warm, 64), 8, chunk_tokens, bias)
        if "mlx-lm" in args.parts:
            os.environ[GATED_DELTA_ENV] = "off"
            run_mlx_lm(loaded.model, prompts(warm, 64), 8)
            os.environ.pop(GATED_DELTA_ENV, None)
        for count in streams:
            if "engine" in args.parts and not deadline.passed():
                record("engine", count,
                       run_engine(engine, prompts(count), args.decode_tokens, chunk_tokens, bias))
            if "greedy" in args.parts and not deadline.passed():
                record("greedy", count,
                       run_engine(engine, prompts(count), args.decode_tokens, chunk_tokens, None))
            if "mlx-lm" in args.parts and not deadline.passed():
                # mlx-lm as shipped: Rewind's gated delta kernel (installed on the model's
                # modules by the loader) steps aside while it runs (read at each call).
                os.environ[GATED_DELTA_ENV] = "off"
                try:
                    record("mlx-lm", count,
                           run_mlx_lm(loaded.model, prompts(count), args.decode_tokens))
                finally:
                    os.environ.pop(GATED_DELTA_ENV, None)
            mx.clear_cache()
        entry["engine_stats"] = {k: v for k, v in engine.stats().items()
                                 if k in ("generated_tokens", "prefilled_tokens",
                                          "cached_tokens", "mlx_peak_bytes", "steps",
                                          "pipelined_steps")}
    finally:
        engine.shutdown()
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


def run(args: argparse.Namespace) -> int:
    from rewind.bench.machine import command_line, machine_info

    if args.quick:
        args.models = args.models or list(QUICK_SHAPES)
        args.streams = [1, 3]
        args.prompt_tokens, args.decode_tokens = 80, 6
    shapes = {**SHAPES, **QUICK_SHAPES}
    names = args.models or list(SHAPES)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"unknown model shape(s) {unknown}; known: {', '.join(shapes)}")
    deadline = Deadline(args.deadline_s)
    report: dict[str, Any] = {
        "command": command_line(), "commit": args.commit, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
        "hbm_bytes_per_s": HBM_BYTES_PER_S, "llama_cpp_quoted": LLAMA_CPP_QUOTED,
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


# ---- the report -------------------------------------------------------------------------------


def _cell(row: dict[str, Any] | None) -> str:
    if not row:
        return "-"
    if "tok_s" not in row:
        return "failed"
    return f"{row['tok_s']:,.0f} ({100 * row['of_bound']:.0f}%)"


def markdown(report: dict[str, Any]) -> str:
    hbm = report["hbm_bytes_per_s"]
    lines = ["# Decode tokens/s at 1, 8 and 32 concurrent streams", "",
             f"Command: `{report['command']}`" + (f" at {report['commit']}"
                                                  if report.get("commit") else ""), "",
             f"Random-weight bf16 models of real shapes; {report['prompt_tokens']}-token "
             f"distinct random prompts arriving together, greedy, timed over the window where "
             f"every stream decodes (at least {report['decode_tokens']} steps). Cells: tokens/s of all "
             "streams together (share of the HBM bound at that row's mean context).", ""]
    # int keys: a report read back from JSON has them as strings
    quoted = {int(k): v for k, v in report["llama_cpp_quoted"]["decode_tok_s"].items()}
    for name, entry in report["models"].items():
        sizes = StreamBytes(**entry["bytes"])
        lines += [f"## {name}", "", f"{entry['compute']}. Weights read per step "
                  f"{sizes.weight_bytes / 1e9:.3f} GB; per stream "
                  f"{sizes.kv_bytes_per_token / 1e3:.1f} kB of KV per token held"
                  + (f" + {sizes.fixed_state_bytes / 1e6:.1f} MB of linear-attention state"
                     if sizes.fixed_state_bytes else "") + ".", ""]
        header = ["streams", "Rewind engine (EOS bias)", "Rewind engine (plain greedy)",
                  "Rewind HTTP (openai client)", "mlx-lm BatchGenerator", "HBM bound"]
        if name.startswith("llama"):
            header.append("llama.cpp CUDA, F16, 32k vocab (quoted)")
        lines += ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
        for count, parts in sorted(entry["rows"].items(), key=lambda kv: int(kv[0])):
            n = int(count)
            context = (parts.get("engine") or parts.get("greedy") or parts.get("mlx-lm")
                       or {}).get("mean_context", report["prompt_tokens"])
            bound = sizes.bound_tok_s(n, context)
            cells = [count, _cell(parts.get("engine")), _cell(parts.get("greedy")),
                     _cell(parts.get("http")), _cell(parts.get("mlx-lm")),
                     f"{bound:,.0f} (at {context:.0f} tokens)"]
            if name.startswith("llama"):
                cells.append(f"{quoted[n]:,}" if n in quoted else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "Bound arithmetic (bytes read per step / "
                  f"{hbm / 1e12:.1f} TB/s):", ""]
        for count, parts in sorted(entry["rows"].items(), key=lambda kv: int(kv[0])):
            n = int(count)
            context = (parts.get("engine") or parts.get("greedy") or parts.get("mlx-lm")
                       or {}).get("mean_context", report["prompt_tokens"])
            step = sizes.step_bytes(n, context)
            state = (f"{n} x ({sizes.kv_bytes_per_token} B x {context:.0f} tokens"
                     + (f" + {sizes.fixed_state_bytes} B" if sizes.fixed_state_bytes else "")
                     + ")")
            lines.append(f"- N={n}: ({sizes.weight_bytes} B + {state}) = {step / 1e9:.3f} GB "
                         f"-> {1e3 * step / hbm:.3f} ms a step -> {n} / that = "
                         f"{sizes.bound_tok_s(n, context):,.0f} tok/s")
        per_step = [(count, parts["engine"]["per_step"]) for count, parts in
                    sorted(entry["rows"].items(), key=lambda kv: int(kv[0]))
                    if "engine" in parts and parts["engine"].get("per_step", {}).get("steps")]
        if per_step:
            lines += ["", "Where an engine decode step goes (mean ms per step of the window, "
                      "timers on the engine thread):", "",
                      "| streams | step | schedule | run (forward) | postprocess (sample, "
                      "emit) | between steps |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: |"]
            for count, p in per_step:
                if "run_ms" not in p:  # a report from before the step was three calls
                    continue
                lines.append(f"| {count} | {p['step_ms']:.2f} | {p['schedule_ms']:.2f} | "
                             f"{p['run_ms']:.2f} | {p['postprocess_ms']:.2f} | "
                             f"{p['between_steps_ms']} |")
        mlx_steps = [(count, parts["mlx-lm"]["step_ms"]) for count, parts in
                     sorted(entry["rows"].items(), key=lambda kv: int(kv[0]))
                     if "step_ms" in parts.get("mlx-lm", {})]
        if mlx_steps:
            lines += ["", "mlx-lm BatchGenerator step: " + ", ".join(
                f"N={c}: {ms:.2f} ms" for c, ms in mlx_steps) + "."]
        kernels = entry.get("kernels")
        if kernels:
            lines += ["", "### CUDA kernel trace (benchmarks/probes/decode_kernels.py)", ""]
            lines += kernel_markdown(kernels)
        if entry.get("http_error"):
            lines += ["", f"HTTP rows failed: {entry['http_error']}"]
        lines.append("")
    lines += ["llama.cpp figures: quoted from shared/GPU.md (llama.cpp's CUDA build on the same "
              "kind of H200, random Llama-3.2-1B-shaped F16 GGUF with a 32k vocabulary, "
              "`llama-batched-bench -npp 512 -ntg 128`), not re-measured here; its 32k head "
              "reads 0.13 GB per step where the 128k one here reads 0.53 GB.", "",
              "## Machine", ""]
    machine = report.get("machine") or {}
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    return "\n".join(lines) + "\n"


def kernel_markdown(kernels: dict[str, Any]) -> list[str]:
    if "error" in kernels:
        return [f"Failed: {kernels['error']}", "", "```", kernels.get("log_tail", ""), "```"]
    lines: list[str] = []
    cases = kernels.get("attention_cases") or []
    if cases:
        lines += ["| decode step on | KV buffer (capacity / held) | attention kernel | "
                  "step ms (wall, median) |", "| --- | --- | --- | ---: |"]
        for case in cases:
            lines.append(f"| {case['case']} | {case.get('kv_buffer', '-')} | "
                         f"{case.get('attention', '-')} | {case.get('step_ms', '-')} |")
        lines.append("")
    for busy in kernels.get("gpu_busy") or []:
        lines.append(f"- {busy['path']} N={busy['streams']}: wall {busy.get('wall_ms_per_step')}"
                     f" ms a step, GPU busy {busy.get('gpu_busy_ms_per_step')} ms "
                     f"({busy.get('kernels_per_step')} kernels a step); top: "
                     + ", ".join(f"{k['name'][:60]} {k['ms_per_step']} ms"
                                 for k in busy.get("top_kernels", [])[:5]))
    if kernels.get("note"):
        lines += ["", kernels["note"]]
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    register(parser)
    sys.exit(run(parser.parse_args()))
