"""A CUPTI trace of this process's GPU work through PyTorch's profiler, and two readings of it.

MLX has no kernel timeline on CUDA (no Metal capture, and Nsight Systems does not run on the
lent machines), but PyTorch's profiler records every kernel of the process through CUPTI, MLX's
included, with its name and its device-side start and duration. Used by the developer probes
benchmarks/probes/decode_profile.py and benchmarks/probes/decode_kernels.py.

Import this before mlx: torch's CUDA libraries must load first. Without a CUDA torch, PROFILE is
None and the trace functions run their argument untraced.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PROFILE", "busy_us", "top_kernels", "trace_events", "traced"]


def _torch_profiler() -> Any | None:
    try:
        import torch  # noqa: F401  (imported before mlx: its CUDA libraries load first)
        from torch.profiler import ProfilerActivity, profile
    except Exception:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    return lambda: profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


PROFILE = _torch_profiler()


def trace_events(run: Callable[[], None]) -> list[dict[str, Any]] | None:
    """Every CUPTI event of the process during `run` (category, name, ts and dur in
    microseconds): kernels, memcpys, runtime/driver calls. None without the profiler."""
    if PROFILE is None:
        run()
        return None
    with PROFILE() as profiler:
        run()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return [{"cat": e.get("cat"), "name": e.get("name", ""), "ts": float(e["ts"]),
             "dur": float(e.get("dur", 0.0))}
            for e in events if e.get("ph") == "X" and "ts" in e]


def traced(run: Callable[[], None]) -> list[dict[str, Any]] | None:
    """The kernels (name, ts and dur in microseconds) that ran on the GPU during `run`."""
    events = trace_events(run)
    if events is None:
        return None
    return [{"name": e["name"], "ts": e["ts"], "dur": e["dur"]}
            for e in events if e["cat"] == "kernel"]


def busy_us(kernels: list[dict[str, Any]]) -> float:
    """Time at least one kernel ran (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k["ts"]):
        start, stop = k["ts"], k["ts"] + k["dur"]
        if start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def top_kernels(kernels: list[dict[str, Any]], steps: int, count: int = 8) -> list[dict]:
    sums: dict[str, list[float]] = {}
    for k in kernels:
        sums.setdefault(k["name"], []).append(k["dur"])
    ranked = sorted(sums.items(), key=lambda item: -sum(item[1]))[:count]
    return [{"name": name, "calls_per_step": round(len(durs) / steps, 1),
             "ms_per_step": round(sum(durs) / steps / 1000, 4)} for name, durs in ranked]
