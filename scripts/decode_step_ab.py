"""Issue 18 (Qwen decode at 32 streams got slower): A/B of the engine's decode step, pipelined or
not, old code or new, with per-part timers and a CUPTI kernel / runtime-API trace.

Run with PYTHONPATH=/tmp/site:<code>/src. Prints JSON lines; writes --json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import types
from collections import defaultdict
from pathlib import Path

try:  # torch first: its CUDA libraries load before MLX's (as rewind.bench.decode_kernels does)
    import torch
    from torch.profiler import ProfilerActivity, profile
    HAVE_TORCH = torch.cuda.is_available()
    if HAVE_TORCH:
        torch.cuda.init()
except Exception:  # noqa: BLE001
    HAVE_TORCH = False

import mlx.core as mx

P = argparse.ArgumentParser()
P.add_argument("--label", required=True)
P.add_argument("--model", default="qwen3.5-0.8b")
P.add_argument("--work-dir", default="/root/models")
P.add_argument("--prompt-tokens", type=int, default=512)
P.add_argument("--streams", type=int, default=32)
P.add_argument("--decode-tokens", type=int, default=128)
P.add_argument("--modes", default="on,off", help="pipeline modes to run (new code); 'default' for old")
P.add_argument("--reps", type=int, default=2)
P.add_argument("--parts", default="bias,greedy")
P.add_argument("--mlx-lm", action="store_true")
P.add_argument("--trace", default="", help="modes to trace, e.g. on,off")
P.add_argument("--trace-parts", default="bias")
P.add_argument("--trace-steps", type=int, default=12)
P.add_argument("--micro", action="store_true")
P.add_argument("--deadline", type=float, default=0.0, help="epoch seconds; skip work after it")
P.add_argument("--json", required=True)
A = P.parse_args()

REPORT: dict = {"label": A.label, "args": vars(A), "mlx": mx.__version__,
                "device": str(mx.default_device()), "runs": [], "traces": [], "micro": []}


def save() -> None:
    Path(A.json).write_text(json.dumps(REPORT, indent=1) + "\n")


def left() -> float:
    return A.deadline - time.time() if A.deadline else 1e9


def out(kind: str, obj: dict) -> None:
    print(json.dumps({"kind": kind, **obj}), flush=True)


import rewind.bench.decode_scaling as DS  # noqa: E402
import rewind.engine.scheduler as S  # noqa: E402
import rewind.engine.sampler as SM  # noqa: E402
from rewind.config import CacheConfig, EngineConfig  # noqa: E402
from rewind.engine import Engine  # noqa: E402

NEW = hasattr(S, "sample_lazy")

# ---- extra timers, recorded on the StepTimers' current record ---------------------------------
CURRENT: list = [None]  # the StepTimers object of the run in progress


def add(key: str, dt: float) -> None:
    timers = CURRENT[0]
    rec = getattr(timers, "_current", None) if timers is not None else None
    if rec is not None:
        rec.__dict__[key] = rec.__dict__.get(key, 0.0) + dt


def timed(fn, key):
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            add(key, time.perf_counter() - t)
    return wrapped


def proxy_mx(prefix: str):
    ns = types.SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})
    ns.eval = timed(mx.eval, prefix + "eval")
    ns.async_eval = timed(mx.async_eval, prefix + "async_eval")
    return ns


S.mx = proxy_mx("sched_")
SM.mx = proxy_mx("sampler_")
if NEW:
    S.sample_lazy = timed(S.sample_lazy, "sample_lazy")
    S.read_samples = timed(S.read_samples, "read_samples")
    S.Scheduler._emit_decoded = timed(S.Scheduler._emit_decoded, "emit_decoded")
    S.Scheduler._pipelined_step = timed(S.Scheduler._pipelined_step, "pipelined_step")
    S.Scheduler._leave_batch = timed(S.Scheduler._leave_batch, "leave_batch")
S.Scheduler._after_decode = timed(S.Scheduler._after_decode, "after_decode")
S.Scheduler._on_token = timed(S.Scheduler._on_token, "on_token")
EXTRA = ["sched_eval", "sched_async_eval", "sampler_eval", "sample_lazy", "read_samples",
         "emit_decoded", "pipelined_step", "leave_batch", "after_decode", "on_token"]

_orig_enter = DS.StepTimers.__enter__
_orig_breakdown = DS.StepTimers.breakdown


def _enter(self):
    CURRENT[0] = self
    return _orig_enter(self)


def _breakdown(self, start, end, rows):
    result = _orig_breakdown(self, start, end, rows)
    steps = [r for r in self.records if r.started >= start and r.ended <= end
             and r.decode_rows == rows and r.prefill_segments == 0]
    if steps:
        for key in EXTRA:
            vals = [r.__dict__.get(key, 0.0) for r in steps]
            if any(vals):
                result[key + "_ms"] = round(1000 * sum(vals) / len(steps), 3)
        durs = sorted(r.ended - r.started for r in steps)
        result["step_ms_median"] = round(1000 * durs[len(durs) // 2], 3)
        result["step_ms_p90"] = round(1000 * durs[int(len(durs) * 0.9)], 3)
    return result


DS.StepTimers.__enter__ = _enter
DS.StepTimers.breakdown = _breakdown


# ---- model and engine -------------------------------------------------------------------------
family, overrides = {**DS.SHAPES, **getattr(DS, "QUICK_SHAPES", {})}[A.model]
t0 = time.perf_counter()
loaded = DS.build_model(A.model, family, overrides, Path(A.work_dir) / A.label)
out("loaded", {"seconds": round(time.perf_counter() - t0, 1)})
vocab = int(loaded.config.get("vocab_size") or overrides.get("vocab_size"))
bias = {t: -100.0 for t in DS.eos_ids(loaded)}
try:
    from rewind.cache.prompt_cache import PromptCache
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig())
except Exception:  # noqa: BLE001  (690ea87)
    from rewind.commands.serve import build_prompt_cache
    prompt_cache = build_prompt_cache(loaded, CacheConfig())
N = A.streams
engine = Engine(loaded, EngineConfig(parallel=N, max_queue=4 * N), prompt_cache=prompt_cache)
engine.start()
sched = engine._scheduler
chunk = engine.runner.chunk_tokens
seed = [100]


def prompts(count, length):
    seed[0] += 1
    return DS.make_prompts(count, length, vocab, seed[0])


def set_mode(mode: str) -> None:
    if mode in ("on", "off"):
        sched.pipeline = mode == "on"


REPORT["pipeline_default"] = getattr(sched, "pipeline", None)
out("engine", {"new": NEW, "pipeline_default": REPORT["pipeline_default"], "chunk": chunk})

# warm-up: every kernel compiled at the full batch, both modes
for mode in A.modes.split(","):
    set_mode(mode)
    DS.run_engine(engine, prompts(N, 64), 8, chunk, bias)
    DS.run_engine(engine, prompts(N, 64), 8, chunk, None)
out("warm", {"seconds": round(time.perf_counter() - t0, 1)})

# ---- timed runs -------------------------------------------------------------------------------
for rep in range(A.reps):
    for mode in A.modes.split(","):
        for part in A.parts.split(","):
            if left() < 25:
                break
            set_mode(mode)
            s0 = engine.stats()
            result = DS.run_engine(engine, prompts(N, A.prompt_tokens), A.decode_tokens, chunk,
                                   bias if part == "bias" else None)
            s1 = engine.stats()
            row = {"rep": rep, "mode": mode, "part": part, "tok_s": result["tok_s"],
                   "total_s": result["total_s"], "mean_context": result["mean_context"],
                   "steps": s1.get("steps", 0) - s0.get("steps", 0),
                   "pipelined_steps": s1.get("pipelined_steps", 0) - s0.get("pipelined_steps", 0),
                   "per_step": result["per_step"]}
            REPORT["runs"].append(row)
            out("run", row)
            save()
            mx.clear_cache()

if A.mlx_lm and left() > 40:
    try:
        from rewind.kernels.gated_delta import ENV as GD
    except Exception:  # noqa: BLE001
        from rewind.engine.gated_delta import ENV as GD
    os.environ[GD] = "off"
    try:
        DS.run_mlx_lm(loaded.model, prompts(N, 64), 8)
        r = DS.run_mlx_lm(loaded.model, prompts(N, A.prompt_tokens), A.decode_tokens)
    finally:
        os.environ.pop(GD, None)
    REPORT["mlx_lm"] = r
    out("mlx_lm", r)
    save()
    mx.clear_cache()


# ---- kernel / runtime-API traces ---------------------------------------------------------------
def summarize(events, steps, seconds):
    kern = [e for e in events if e.get("cat") == "kernel"]
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    busy, end = 0.0, float("-inf")
    for k in sorted(kern, key=lambda k: k["ts"]):
        a, b = k["ts"], k["ts"] + k.get("dur", 0.0)
        if a >= end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b

    def top(evs, count):
        sums = defaultdict(list)
        for e in evs:
            sums[e["name"]].append(float(e.get("dur", 0.0)))
        ranked = sorted(sums.items(), key=lambda kv: -sum(kv[1]))[:count]
        return [{"name": n[:110], "calls": round(len(d) / steps, 1),
                 "ms": round(sum(d) / steps / 1000, 4),
                 "us_mean": round(sum(d) / len(d), 1), "us_max": round(max(d), 1)}
                for n, d in ranked]

    copies = [e for e in kern if "copy_v<unsigned int" in e["name"]]
    return {"steps": round(steps, 1), "wall_ms": round(1000 * seconds / steps, 3),
            "busy_ms": round(busy / steps / 1000, 3), "kernels": round(len(kern) / steps, 1),
            "top_kernels": top(kern, 14), "top_api": top(api, 10),
            "copy_v_u32_durs_us": sorted(round(float(e.get("dur", 0)), 1) for e in copies)[:64]}


def trace(mode: str, part: str) -> dict:
    from rewind.engine import GenerationRequest, SamplingParams
    set_mode(mode)
    handles = [engine.submit(GenerationRequest(
        prompt_tokens=p, params=SamplingParams(temperature=0.0, max_tokens=100_000,
                                               logit_bias=bias if part == "bias" else None)))
        for p in prompts(N, 256)]
    drains = [threading.Thread(target=h.collect, daemon=True) for h in handles]
    for d in drains:
        d.start()
    deadline = time.monotonic() + 120
    while engine.stats()["decoding"] < N and time.monotonic() < deadline:
        time.sleep(0.005)

    def wait_tokens(n):
        target = engine.stats()["generated_tokens"] + n
        while engine.stats()["generated_tokens"] < target:
            time.sleep(0.0005)

    for _ in range(5):
        wait_tokens(N)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        before = engine.stats()["generated_tokens"]
        started = time.perf_counter()
        wait_tokens(N * A.trace_steps)
        seconds = time.perf_counter() - started
        done = (engine.stats()["generated_tokens"] - before) / N
    for h in handles:
        h.cancel()
    time.sleep(0.3)
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "t.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return {"mode": mode, "part": part, **summarize(events, done, seconds)}


if HAVE_TORCH:
    for mode in [m for m in A.trace.split(",") if m]:
        for part in A.trace_parts.split(","):
            if left() < 25:
                break
            try:
                row = trace(mode, part)
            except Exception as exc:  # noqa: BLE001
                row = {"mode": mode, "part": part, "error": f"{type(exc).__name__}: {exc}"}
            REPORT["traces"].append(row)
            out("trace", {k: v for k, v in row.items() if k != "copy_v_u32_durs_us"})
            save()
            mx.clear_cache()

engine.shutdown()


# ---- micro: which op launches copy_v<unsigned int> -----------------------------------------------
def micro(name, fn, iters=10):
    fn()
    mx.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        mx.synchronize()
        seconds = time.perf_counter() - t
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "t.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    row = {"case": name, **summarize(events, iters, seconds)}
    row.pop("top_api", None)
    REPORT["micro"].append(row)
    out("micro", row)
    save()


if A.micro and HAVE_TORCH and left() > 20:
    logits = mx.random.normal((N, vocab)).astype(mx.bfloat16)
    mx.eval(logits)
    ids = mx.array(sorted(bias), dtype=mx.int32)
    vals = mx.array([-100.0] * len(bias), dtype=mx.float32)

    def per_row_stack():
        toks = []
        for r in range(N):
            row = logits[r].astype(mx.float32)
            row[ids] = row[ids] + vals
            toks.append(mx.argmax(row))
        t = mx.stack(toks).reshape(-1)
        mx.eval(t)
        t.tolist()

    def per_row_items():
        toks = []
        for r in range(N):
            row = logits[r].astype(mx.float32)
            row[ids] = row[ids] + vals
            toks.append(mx.argmax(row))
        mx.eval(toks)
        [int(t.item()) for t in toks]

    def argmax_batch():
        t = mx.argmax(logits, axis=-1)
        mx.eval(t)
        t.tolist()

    def stack_only():
        toks = [mx.argmax(logits[r]) for r in range(N)]
        mx.eval(toks)
        t = mx.stack(toks)
        mx.eval(t)

    def offset_add():
        off = mx.zeros((N,), dtype=mx.int32)
        for _ in range(16):
            off = off + 1
        mx.eval(off)

    for name, fn in [("per_row_stack", per_row_stack), ("per_row_items", per_row_items),
                     ("argmax_batch", argmax_batch), ("stack_only", stack_only),
                     ("offset_add_x16", offset_add)]:
        try:
            micro(name, fn)
        except Exception as exc:  # noqa: BLE001
            out("micro", {"case": name, "error": f"{type(exc).__name__}: {exc}"})
save()
out("done", {"seconds": round(time.perf_counter() - t0, 1)})
