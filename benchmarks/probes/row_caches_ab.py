"""Decode step time of the default model on the CPU kernels with N rows: the decode batch as the
rows' own caches (`RowCaches`, what the engine runs: each row its own segment of the shared
pass) against one merged batch cache (what it ran before, and what GPUs run).

    PYTHONPATH=src LD_PRELOAD=$(python -m rewind.blas --preload-value) \
        python benchmarks/probes/row_caches_ab.py CONTEXT ROWS

Prints the median step time of each, twice, alternating.
"""
from __future__ import annotations

import sys
import time

import mlx.core as mx

from rewind.engine.runner import ModelRunner, RowCaches, Segment
from rewind.models.loader import load_model


def main() -> None:
    context = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    loaded = load_model("default")
    runner = ModelRunner(getattr(loaded, "model", loaded))

    def prefilled(seed: int) -> list:
        cache = runner.new_cache()
        runner.prefill(cache, [(seed * 7 + i * 13) % 1000 + 10 for i in range(context)])
        return cache

    def median_step_ms(mode: str, steps: int = 40) -> float:
        singles = [prefilled(seed) for seed in range(rows)]
        if mode == "rows":
            batch: list = RowCaches(singles)
        else:
            batch = [layer.merge([layer]) for layer in singles[0]]
            for single in singles[1:]:
                for batch_layer, layer in zip(batch, single):
                    batch_layer.extend(layer.merge([layer]))
        tokens = mx.array([[5]] * rows)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            logits = runner.forward([Segment(tokens, batch, logits=True)])[0]
            tokens = mx.argmax(logits, axis=-1).reshape(rows, 1)
            mx.eval(tokens)
            times.append(time.perf_counter() - started)
        times = sorted(times[5:])
        return times[len(times) // 2] * 1e3

    for mode in ("rows", "merged", "rows", "merged"):
        print(f"{mode}: context {context}, {rows} rows: {median_step_ms(mode):.1f} ms a step")


if __name__ == "__main__":
    main()
