"""Timing of in-process calls for the kernel benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(call: Callable[[], object], runs: int) -> float:
    """The median wall time of `runs` calls, after one untimed call (compiles, caches)."""
    call()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
