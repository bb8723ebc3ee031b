"""Where a decode step's host time goes (issue 27, "profile before changing anything"): Rewind's
engine, all N streams decoding, on a random-weight model as `rewind bench decode-scaling` builds
it (Llama-3.2-1B shape by default), at 1 and 32 streams.

A developer probe, not a `rewind bench` workload: run it from the repository root with Rewind
importable, as its own process, so that torch (when the machine has a CUDA one) is imported
before MLX and its profiler can record MLX's kernels through CUPTI:

    PYTHONPATH=src python benchmarks/probes/decode_profile.py \
        --json benchmarks/results/gpu/decode-step-profile.json

Four passes per stream count, each over steps where every row decodes and nothing prefills,
on the same running requests (consumed by asyncio tasks, as the HTTP routes consume them):

1. bare: nothing wrapped; wall time per step from the engine's own step counter.
2. timers: time.perf_counter around each piece of the step, wrapped on the engine's objects and
   modules from outside (nothing in the engine changes): the model's graph building
   (`ModelRunner._one`, `_heads`), the sampler's graph (`sample_lazy`), MLX's dispatch of the
   queued step (`mx.async_eval` as the scheduler calls it: the graph walk and every kernel's
   encoding and launch), the wait for the previous step's tokens (`mx.eval` inside
   `read_samples`) and reading them (`tolist`), detokenizing (`TextStream.add`), handing events
   to the consumers (`RequestHandle._deliver`), cache bookkeeping (`_decode_checkpoints`,
   `_leave_batch`); what is left of `Scheduler.step` is the scheduler's own Python.
3. cProfile on the engine thread only (enabled inside each step): the functions that take the
   time, and the calls that synchronize (`tolist`, `item`, `eval`) per step. cProfile slows
   Python, so its times are read as shares, not as the step's cost.
4. trace (torch.profiler / CUPTI, where torch has CUDA): GPU busy time per step (the union of
   kernel intervals) against the step's wall time, kernels per step, and the CUDA runtime and
   driver calls the host made (launches, graph instantiation and updates, synchronizations).

Then, outside the engine, a bare MLX loop on the same batch (forward graph, argmax, async_eval,
read the previous step's tokens): what a step costs with no scheduler at all.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.bench.cupti_trace import (  # torch before mlx
    PROFILE, busy_us, top_kernels, trace_events)

PROG = "benchmarks/probes/decode_profile.py"
RESULTS = Path("benchmarks/results/gpu")
# Exclusive pieces of a step, in the order of the report; `scheduler_python` is the rest.
PIECES = {
    "graph_build_model": "graph building: the model's layers (ModelRunner._one)",
    "graph_build_head": "graph building: the output head (ModelRunner._heads)",
    "forward_other": "forward call, the rest (segments, split lookup)",
    "forward_eval": "mx.eval inside forward (unpipelined steps only)",
    "sample_graph": "sampling graph (sample_lazy: batched argmax, logit bias)",
    "dispatch_async_eval": "MLX dispatch: mx.async_eval of the queued step (graph walk, kernel "
                           "encoding and launch)",
    "sync_wait": "sync: mx.eval of the previous step's tokens (waits for the GPU)",
    "read_tokens": "reading tokens to Python (tolist, Sampled)",
    "detokenize": "detokenizing and stop strings (TextStream.add / finish)",
    "emit": "handing events to the consumers (RequestHandle._deliver)",
    "token_other": "per-token bookkeeping (Emission.on_token: counters, listeners, max_tokens)",
    "cache_bookkeeping": "cache bookkeeping (_decode_checkpoints, _leave_batch)",
    "scheduler_python": "scheduler Python (Scheduler.step minus all of the above)",
}


@dataclass
class Step:
    started: float
    ended: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    decode_rows: int = 0
    prefill_segments: int = 0

    def add(self, name: str, value: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + value
        self.calls[name] = self.calls.get(name, 0) + 1


class _TimedMx:
    """mlx.core as a module sees it, with some functions timed into the current step."""

    def __init__(self, mx: Any, profiler: StepProfiler, timed: dict[str, str]) -> None:
        self._mx, self._profiler, self._timed = mx, profiler, timed

    def __getattr__(self, name: str) -> Any:
        function = getattr(self._mx, name)
        piece = self._timed.get(name)
        if piece is None:
            return function
        return self._profiler.timed(function, piece)


class StepProfiler:
    """Wraps the pieces of the engine's step from outside, on its objects and modules; `__exit__`
    puts every one back. The engine thread records; the caller reads between passes."""

    def __init__(self, engine: Any, pieces: bool = True) -> None:
        import rewind.engine.engine as engine_module
        import rewind.engine.runner as runner_module
        import rewind.engine.sampler as sampler_module
        import rewind.engine.scheduler as scheduler_module
        import rewind.engine.stops as stops_module

        self.engine = engine
        self.pieces = pieces  # False: only the step (and its rows) for cProfile's own view
        self.scheduler = engine._scheduler
        self.runner = engine.runner
        self.modules = {"scheduler": scheduler_module, "sampler": sampler_module,
                        "runner": runner_module}
        self.stops, self.engine_module = stops_module, engine_module
        self.steps: list[Step] = []
        self.current: Step | None = None
        self.recording = False
        self.cprofile: cProfile.Profile | None = None
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def timed(self, function: Callable[..., Any], piece: str) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            step = self.current
            if step is None:
                return function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                step.add(piece, time.perf_counter() - started)
        return wrapped

    def _set(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        self._saved.append((owner, name, getattr(owner, name), had))
        setattr(owner, name, value)

    def __enter__(self) -> StepProfiler:
        import mlx.core as mx

        scheduler, runner = self.scheduler, self.runner
        step, forward = self.engine.step, runner.forward

        def profiled_step() -> bool:
            record = Step(time.perf_counter())
            self.current = record
            profile = self.cprofile
            if profile is not None:
                profile.enable()
            try:
                did = step()
            finally:
                if profile is not None:
                    profile.disable()
                record.ended = time.perf_counter()
                self.current = None
            if did and self.recording:
                self.steps.append(record)
            return did

        def profiled_forward(segments: list[Any], evaluate: bool = True) -> Any:
            record = self.current
            for segment in segments:
                if record is None:
                    break
                rows, length = segment.tokens.shape[:2]
                if length == 1 and segment.cache is scheduler.batch_cache:
                    record.decode_rows += rows
                else:
                    record.prefill_segments += 1
            return self.timed(forward, "forward")(segments, evaluate)

        self._set(self.engine, "step", profiled_step)
        self._set(runner, "forward", profiled_forward)
        if not self.pieces:
            return self
        self._set(runner, "_one", self.timed(runner._one, "graph_build_model"))
        self._set(runner, "_heads", self.timed(runner._heads, "graph_build_head"))
        # The piece keeps the name published results use: `_on_token` was the scheduler's
        # method before token emission moved to rewind.engine.emission.
        emission = scheduler.emission
        self._set(emission, "on_token", self.timed(emission.on_token, "_on_token"))
        for name in ("_decode_checkpoints", "_leave_batch"):
            self._set(scheduler, name, self.timed(getattr(scheduler, name), name))
        module = self.modules["scheduler"]
        self._set(module, "sample_lazy", self.timed(module.sample_lazy, "sample_graph"))
        self._set(module, "read_samples", self.timed(module.read_samples, "read_samples"))
        self._set(module, "mx", _TimedMx(mx, self, {"async_eval": "dispatch_async_eval"}))
        self._set(self.modules["sampler"], "mx", _TimedMx(mx, self, {"eval": "sync_wait"}))
        self._set(self.modules["runner"], "mx", _TimedMx(mx, self, {"eval": "forward_eval"}))
        text = self.stops.TextStream
        self._set(text, "add", self._method(text.add, "detokenize"))
        self._set(text, "finish", self._method(text.finish, "detokenize"))
        return self

    def _method(self, function: Callable[..., Any], piece: str) -> Callable[..., Any]:
        timed = self.timed(function, piece)

        def method(this: Any, *args: Any) -> Any:
            return timed(this, *args)
        return method

    def wrap_deliver(self, handle: Any) -> None:
        """A request's event sink (bound at submit, so wrapped per sequence once queued)."""
        if not self.pieces:
            return
        for seq in [*self.scheduler.decoding, *self.scheduler.prefilling,
                    *self.scheduler.waiting]:
            if not getattr(seq, "_profiled", False):
                seq.emit = self.timed(seq.emit, "emit")
                seq._profiled = True

    def __exit__(self, *exc: object) -> None:
        for owner, name, value, had in reversed(self._saved):
            if had or isinstance(owner, type):
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self._saved.clear()

    # ---- reading ------------------------------------------------------------------------------

    def decode_steps(self, rows: int) -> list[Step]:
        return [s for s in self.steps if s.decode_rows == rows and s.prefill_segments == 0]


def breakdown(steps: list[Step]) -> dict[str, Any]:
    """Mean ms per step of each exclusive piece, and its share of the step."""
    if not steps:
        return {"steps": 0}
    count = len(steps)

    def mean(name: str) -> float:
        return sum(s.seconds.get(name, 0.0) for s in steps) / count

    step_s = sum(s.ended - s.started for s in steps) / count
    on_token, read = mean("_on_token"), mean("read_samples")
    build = mean("graph_build_model") + mean("graph_build_head")
    pieces = {
        "graph_build_model": mean("graph_build_model"),
        "graph_build_head": mean("graph_build_head"),
        "forward_other": mean("forward") - build - mean("forward_eval"),
        "forward_eval": mean("forward_eval"),
        "sample_graph": mean("sample_graph"),
        "dispatch_async_eval": mean("dispatch_async_eval"),
        "sync_wait": mean("sync_wait"),
        "read_tokens": read - mean("sync_wait"),
        "detokenize": mean("detokenize"),
        "emit": mean("emit"),
        "token_other": on_token - mean("detokenize") - mean("emit"),
        "cache_bookkeeping": mean("_decode_checkpoints") + mean("_leave_batch"),
    }
    pieces["scheduler_python"] = step_s - sum(pieces.values())
    names = sorted({name for s in steps for name in s.calls})
    calls = {name: round(sum(s.calls.get(name, 0) for s in steps) / count, 2) for name in names}
    gaps = [b.started - a.ended for a, b in zip(steps, steps[1:]) if b.started - a.ended < 0.5]
    gap_s = sum(gaps) / len(gaps) if gaps else 0.0
    cycle = step_s + gap_s
    # a one-off (a kernel built inside the pass) shows here, where the means spread it
    slowest = [{"step": steps.index(s), "ms": round(1e3 * (s.ended - s.started), 3),
                "pieces_ms": {k: round(1e3 * v, 3) for k, v in s.seconds.items()},
                "calls": dict(s.calls)}
               for s in sorted(steps, key=lambda s: s.started - s.ended)[:3]]
    return {"steps": count, "step_ms": round(1e3 * step_s, 3),
            "slowest_steps": slowest,
            "between_steps_ms": round(1e3 * gap_s, 3), "cycle_ms": round(1e3 * cycle, 3),
            "pieces_ms": {k: round(1e3 * v, 3) for k, v in pieces.items()},
            "pieces_share_of_step": {k: round(v / step_s, 3) for k, v in pieces.items()},
            "calls_per_step": calls}


def cprofile_summary(profile: cProfile.Profile, steps: int, top: int = 30) -> dict[str, Any]:
    stats = pstats.Stats(profile)
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        where = name if filename == "~" else f"{_short(filename)}:{line}({name})"
        rows.append((where, calls, tottime, cumtime))
    total = sum(r[2] for r in rows)

    def per_step(row: tuple[str, int, float, float]) -> dict[str, Any]:
        return {"function": row[0], "calls_per_step": round(row[1] / steps, 2),
                "tottime_ms_per_step": round(1e3 * row[2] / steps, 4),
                "cumtime_ms_per_step": round(1e3 * row[3] / steps, 4)}

    syncs = {}
    for where, calls, tottime, _ in rows:
        for mark in ("'tolist'", "'item'", "mlx.core.eval", "mlx.core.async_eval",
                     "built-in method eval", "built-in method async_eval"):
            if mark in where:
                syncs[where] = {"calls_per_step": round(calls / steps, 2),
                                "ms_per_step": round(1e3 * tottime / steps, 4)}
    return {"steps": steps, "profiled_ms_per_step": round(1e3 * total / steps, 3),
            "by_tottime": [per_step(r) for r in sorted(rows, key=lambda r: -r[2])[:top]],
            "by_cumtime": [per_step(r) for r in sorted(rows, key=lambda r: -r[3])[:top]],
            "sync_calls": syncs,
            "python_calls_per_step": round(sum(r[1] for r in rows) / steps, 1)}


def _short(filename: str) -> str:
    for mark in ("site-packages/", "/src/"):
        if mark in filename:
            return filename.split(mark, 1)[1]
    return filename


def trace_summary(events: list[dict[str, Any]] | None, steps: int,
                  wall_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": steps, "wall_ms_per_step": round(1e3 * wall_s / steps, 3)}
    if events is None:
        out["note"] = "no CUDA torch in this process: no kernel trace"
        return out
    kernels = [e for e in events if e["cat"] == "kernel"]
    copies = [e for e in events if e["cat"] in ("gpu_memcpy", "gpu_memset")]
    busy = busy_us(kernels + copies)
    out.update({
        "gpu_busy_ms_per_step": round(busy / steps / 1e3, 3),
        "gpu_busy_share_of_wall": round(busy / 1e6 / wall_s, 3) if wall_s else None,
        "kernels_per_step": round(len(kernels) / steps, 1),
        "copies_per_step": round(len(copies) / steps, 2),
        "top_kernels": top_kernels(kernels, steps, 10)})
    api: dict[str, list[float]] = {}
    for e in events:
        if e["cat"] in ("cuda_runtime", "cuda_driver"):
            api.setdefault(e["name"], []).append(e["dur"])
    out["host_api_ms_per_step"] = round(sum(sum(v) for v in api.values()) / steps / 1e3, 3)
    out["host_api"] = [{"call": name, "calls_per_step": round(len(d) / steps, 2),
                        "ms_per_step": round(sum(d) / steps / 1e3, 4)}
                       for name, d in sorted(api.items(), key=lambda kv: -sum(kv[1]))[:15]]
    return out


# ---- driving the engine ------------------------------------------------------------------------


class Streams:
    """N requests decoding for as long as asked, consumed by asyncio tasks on a thread of their
    own (as the server's routes consume them); `stop()` cancels them and waits for the end."""

    def __init__(self, engine: Any, prompts: list[list[int]], bias: dict[int, float],
                 consume: bool = True) -> None:
        from rewind.engine import GenerationRequest, SamplingParams

        self.engine = engine
        self.handles = [engine.submit(GenerationRequest(
            prompt_tokens=p, params=SamplingParams(temperature=0.0, max_tokens=100_000,
                                                   logit_bias=bias))) for p in prompts]
        self.tokens = 0
        # consume=False: events pile up in each handle's queue, read by nobody (no consumer
        # thread competing with the engine thread for the GIL).
        self._thread = threading.Thread(target=self._run, daemon=True) if consume else None
        if self._thread is not None:
            self._thread.start()

    def _run(self) -> None:
        async def consume(handle: Any) -> None:
            async for _ in handle:
                self.tokens += 1

        async def main() -> None:
            await asyncio.gather(*(consume(h) for h in self.handles))

        asyncio.run(main())

    def stop(self) -> None:
        for handle in self.handles:
            handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=60)
        deadline = time.monotonic() + 60
        while self.engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)


def wait_until(condition: Callable[[], bool], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not reach the state in time")
        time.sleep(0.0005)


def profile_streams(engine: Any, profiler: StepProfiler, prompts: list[list[int]],
                    bias: dict[int, float], args: argparse.Namespace) -> dict[str, Any]:
    rows = len(prompts)
    stats = engine.stats
    streams = Streams(engine, prompts, bias)
    out: dict[str, Any] = {"streams": rows}
    try:
        wait_until(lambda: stats()["decoding"] == rows and stats()["prefilling"] == 0)
        base = stats()["steps"]
        wait_until(lambda: stats()["steps"] >= base + 8)  # settled at the full batch

        # 1. bare: wall per step from the engine's counter, nothing wrapped.
        out["bare"] = bare_pass(engine, rows, args.steps)

        with profiler:
            profiler.wrap_deliver(None)
            # 2. timers
            profiler.steps.clear()
            profiler.recording = True
            wait_until(lambda: len(profiler.decode_steps(rows)) >= args.steps)
            profiler.recording = False
            out["timers"] = breakdown(profiler.decode_steps(rows))
        # 3. cProfile on the engine thread, with only the step wrapped (MLX's own calls, which
        # cProfile does not see as functions, count in the Python function that made them).
        with StepProfiler(profiler.engine, pieces=False) as profiler:
            profile = cProfile.Profile()
            profiler.steps.clear()
            profiler.cprofile = profile
            profiler.recording = True
            wait_until(lambda: len(profiler.decode_steps(rows)) >= args.cprofile_steps)
            profiler.recording = False
            profiler.cprofile = None
            counted = len(profiler.steps)
            out["cprofile"] = cprofile_summary(profile, counted)
            steps = profiler.decode_steps(rows)
            out["cprofile"]["step_ms_under_cprofile"] = round(
                1e3 * sum(s.ended - s.started for s in steps) / max(1, len(steps)), 3)

        # 4. trace (nothing wrapped but the profiler's own hooks)
        counted_trace: dict[str, float] = {}

        def traced() -> None:
            first, begun = stats()["steps"], time.perf_counter()
            wait_until(lambda: stats()["steps"] >= first + args.trace_steps)
            counted_trace["seconds"] = time.perf_counter() - begun
            counted_trace["steps"] = stats()["steps"] - first

        events = trace_events(traced)
        out["trace"] = trace_summary(events, int(counted_trace["steps"]),
                                     counted_trace["seconds"])
        out["context_at_end"] = args.prompt_tokens + streams.tokens // rows
    finally:
        streams.stop()
    # The bare pass again with nobody reading the events: what the consumers' thread costs the
    # engine thread (the GIL, call_soon_threadsafe's wake-ups).
    quiet = Streams(engine, [p[::-1] for p in prompts], bias, consume=False)
    try:
        wait_until(lambda: stats()["decoding"] == rows and stats()["prefilling"] == 0)
        base = stats()["steps"]
        wait_until(lambda: stats()["steps"] >= base + 8)
        out["bare_no_consumer"] = bare_pass(engine, rows, args.steps)
    finally:
        quiet.stop()
    print(json.dumps({k: v for k, v in out.items() if k != "cprofile"}), flush=True)
    return out


def bare_pass(engine: Any, rows: int, steps: int) -> dict[str, Any]:
    stats = engine.stats
    first, started = stats()["steps"], time.perf_counter()
    wait_until(lambda: stats()["steps"] >= first + steps)
    seconds = time.perf_counter() - started
    done = stats()["steps"] - first
    return {"steps": done, "step_ms": round(1e3 * seconds / done, 3),
            "tok_s": round(rows * done / seconds, 1)}


def bare_loop(runner: Any, loaded: Any, rows: int, prompt_tokens: int, vocab: int,
              steps: int) -> dict[str, Any]:
    """Rows prefilled alone and joined into one batch (as the engine does), then a pipelined loop
    of MLX calls only: forward graph, argmax, async_eval, then read the previous tokens."""
    import mlx.core as mx

    from rewind.bench.decode_scaling_models import make_prompts
    from rewind.engine.runner import Segment

    batch = None
    for prompt in make_prompts(rows, prompt_tokens, vocab, seed=1000 + rows):
        cache = runner.new_cache()
        runner.prefill(cache, prompt, logits=False)
        batch = runner.join(batch, cache)
    previous = mx.array([100 + r for r in range(rows)])
    mx.eval(previous)
    build = dispatch = read = 0.0
    started = time.perf_counter()
    for index in range(steps + 5):
        if index == 5:
            build = dispatch = read = 0.0
            started = time.perf_counter()
        t0 = time.perf_counter()
        logits = runner.forward([Segment(previous.reshape(-1, 1), batch, logits=True)],
                                evaluate=False)[0]
        tokens = mx.argmax(logits, axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(tokens)
        t2 = time.perf_counter()
        previous.tolist()
        t3 = time.perf_counter()
        build, dispatch, read = build + t1 - t0, dispatch + t2 - t1, read + t3 - t2
        previous = tokens
    previous.tolist()
    seconds = time.perf_counter() - started
    del batch
    mx.clear_cache()
    return {"streams": rows, "steps": steps, "step_ms": round(1e3 * seconds / steps, 3),
            "graph_build_ms": round(1e3 * build / steps, 3),
            "dispatch_async_eval_ms": round(1e3 * dispatch / steps, 3),
            "wait_and_read_ms": round(1e3 * read / steps, 3)}


# ---- the run -----------------------------------------------------------------------------------


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b",
                        help="a shape of rewind bench decode-scaling (SHAPES or QUICK_SHAPES)")
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=128, help="steps of the bare and timer passes")
    parser.add_argument("--cprofile-steps", type=int, default=48)
    parser.add_argument("--trace-steps", type=int, default=20)
    parser.add_argument("--pipeline-decode", choices=["auto", "on", "off"], default="auto",
                        help="the engine's pipelined decode (auto: on wherever MLX is not on "
                             "the CPU, as rewind serve runs it)")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", type=Path, default=RESULTS / "decode-step-profile.json")


def run(args: argparse.Namespace) -> int:
    import tempfile

    import mlx.core as mx

    from rewind.bench.decode_scaling_models import (QUICK_SHAPES, SHAPES, build_model, eos_ids,
                                                    make_prompts)
    from rewind.bench.machine import _display_arg, command_line, machine_info
    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine
    from rewind.engine.runner import ModelRunner

    shapes = {**SHAPES, **QUICK_SHAPES}
    family, overrides = shapes[args.model]
    command = command_line()
    if sys.argv and sys.argv[0].endswith("decode_profile.py"):  # run as a script, not by a test
        command = " ".join([f"python {PROG}", *(_display_arg(a) for a in sys.argv[1:])])
    report: dict[str, Any] = {"command": command, "commit": args.commit,
                              "model": args.model, "family": family,
                              "prompt_tokens": args.prompt_tokens,
                              "profiler": "torch.profiler (CUPTI)" if PROFILE else None,
                              "pieces": PIECES, "rows": {}}

    def save() -> None:
        report["machine"] = machine_info()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        args.json.with_suffix(".md").write_text(markdown(report))

    with tempfile.TemporaryDirectory(prefix="rewind-decode-profile-") as scratch:
        work_dir = args.work_dir or Path(scratch)
        loaded = build_model(args.model, family, overrides, work_dir)
        vocab = int(loaded.config.get("vocab_size") or overrides.get("vocab_size"))
        bias = {t: -100.0 for t in eos_ids(loaded)}
        streams = sorted(set(args.streams))
        pipeline = {"auto": None, "on": True, "off": False}[args.pipeline_decode]
        engine = Engine(loaded, EngineConfig(parallel=max(streams), max_queue=4 * max(streams),
                                             pipeline_decode=pipeline),
                        prompt_cache=PromptCache(loaded.model, loaded.fingerprint,
                                                 CacheConfig())).start()
        report["pipelined"] = engine._scheduler.pipeline
        profiler = StepProfiler(engine)
        try:
            # Warm-up: every batch size's kernels and cuDNN graphs built before timing, and the
            # decode checkpoints' (the prompts end 8 tokens before a 256-token block boundary,
            # so every row checkpoints from the merged batch while it decodes: a 32-row decode
            # checkpoint once took 3.8 s in a timed pass whose warm-up reached none,
            # decode-profile-h100-e8faf41).
            warm = Streams(engine, make_prompts(max(streams), 248, vocab, 1), bias)
            wait_until(lambda: engine.stats()["generated_tokens"] >= 16 * max(streams))
            warm.stop()
            for seed, rows in enumerate(streams, start=10):
                report["rows"][str(rows)] = profile_streams(
                    engine, profiler, make_prompts(rows, args.prompt_tokens, vocab, seed), bias,
                    args)
                save()
                mx.clear_cache()
        finally:
            engine.shutdown()
        runner = ModelRunner(loaded.model)
        for rows in streams:
            try:
                report["rows"][str(rows)]["mlx_loop"] = bare_loop(
                    runner, loaded, rows, args.prompt_tokens, vocab, args.steps)
            except Exception as exc:  # the engine's rows stand without it
                report["rows"][str(rows)]["mlx_loop"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(report["rows"][str(rows)]["mlx_loop"]), flush=True)
            save()
    save()
    print(markdown(report))
    return 0


# ---- the report --------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    counts = sorted(rows, key=int)
    lines = [f"# Where a decode step's host time goes ({report['model']}, random bf16 weights)",
             "", f"Command: `{report['command']}`"
             + (f" at {report['commit']}" if report.get("commit") else ""), "",
             f"Rewind's engine (pipelined decode: {report.get('pipelined')}), N streams of "
             f"{report['prompt_tokens']}-token random prompts, greedy with an EOS ban, every "
             "row decoding; mean per step.", ""]
    header = "| piece | " + " | ".join(f"N={n} ms | N={n} share" for n in counts) + " |"
    lines += [header, "| --- |" + " ---: | ---: |" * len(counts)]
    for key, label in report["pieces"].items():
        cells = []
        for n in counts:
            timers = rows[n].get("timers", {})
            cells += [f"{timers.get('pieces_ms', {}).get(key, 0):.3f}",
                      f"{100 * timers.get('pieces_share_of_step', {}).get(key, 0):.1f}%"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for title, key in (("step (Scheduler.step), timers on", "step_ms"),
                       ("between steps (engine loop)", "between_steps_ms")):
        lines.append(f"| **{title}** | " + " | ".join(
            f"{rows[n].get('timers', {}).get(key, 0):.3f} | " for n in counts) + " |")
    lines.append("| **step, nothing wrapped (bare pass)** | " + " | ".join(
        f"{rows[n].get('bare', {}).get('step_ms', 0):.3f} | "
        f"{rows[n].get('bare', {}).get('tok_s', 0):,.0f} tok/s" for n in counts) + " |")
    lines.append("| **step, nothing wrapped, nobody reading the events** | " + " | ".join(
        f"{rows[n].get('bare_no_consumer', {}).get('step_ms', 0):.3f} | "
        f"{rows[n].get('bare_no_consumer', {}).get('tok_s', 0):,.0f} tok/s" for n in counts)
        + " |")
    lines += ["", "## GPU busy against wall (CUPTI trace)", "",
              "| N | wall ms/step | GPU busy ms/step | busy share | kernels/step | "
              "CUDA API host ms/step |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in counts:
        t = rows[n].get("trace", {})
        lines.append(f"| {n} | {t.get('wall_ms_per_step')} | {t.get('gpu_busy_ms_per_step')} | "
                     f"{t.get('gpu_busy_share_of_wall')} | {t.get('kernels_per_step')} | "
                     f"{t.get('host_api_ms_per_step')} |")
    for n in counts:
        t = rows[n].get("trace", {})
        if t.get("host_api"):
            lines += ["", f"CUDA runtime/driver calls at N={n} (per step): " + "; ".join(
                f"{a['call']} x{a['calls_per_step']} {a['ms_per_step']} ms"
                for a in t["host_api"][:8])]
        if t.get("top_kernels"):
            lines += ["", f"Top kernels at N={n} (per step): " + "; ".join(
                f"{k['name'][:50]} x{k['calls_per_step']} {k['ms_per_step']} ms"
                for k in t["top_kernels"][:5])]
        if t.get("note"):
            lines += ["", f"N={n}: {t['note']}"]
    lines += ["", "## MLX alone (no scheduler: forward graph, argmax, async_eval, read the "
              "previous tokens)", "", "| N | step ms | graph build | async_eval | wait + read |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for n in counts:
        m = rows[n].get("mlx_loop", {})
        lines.append(f"| {n} | {m.get('step_ms')} | {m.get('graph_build_ms')} | "
                     f"{m.get('dispatch_async_eval_ms')} | {m.get('wait_and_read_ms')} |")
    for n in counts:
        c = rows[n].get("cprofile")
        if not c:
            continue
        lines += ["", f"## cProfile of the engine thread, N={n} ({c['steps']} steps; "
                  f"{c['python_calls_per_step']} Python-level calls a step; times inflated by "
                  "cProfile)", "", "| function | calls/step | tottime ms/step | cumtime ms/step |",
                  "| --- | ---: | ---: | ---: |"]
        for r in c["by_tottime"][:15]:
            lines.append(f"| `{r['function'][:90]}` | {r['calls_per_step']} | "
                         f"{r['tottime_ms_per_step']} | {r['cumtime_ms_per_step']} |")
        if c.get("sync_calls"):
            lines += ["", "Synchronizing calls per step: " + "; ".join(
                f"`{k[:60]}` x{v['calls_per_step']} ({v['ms_per_step']} ms)"
                for k, v in c["sync_calls"].items())]
    lines += ["", "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in (report.get("machine") or {}).items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python {PROG}", description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
