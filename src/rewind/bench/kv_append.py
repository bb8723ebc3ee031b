"""KV append: per-token concatenate vs. preallocated 256-token chunks updated in place.

Reproduces the measurement behind MLX's advice on caches: 20 caches of shape [1, 4, N, 512]
bfloat16 each receive one token per step. `concatenate` copies the whole cache every step
(cost grows with N); `preallocated` keeps a buffer grown 256 positions at a time and writes the
new token with a slice update (mlx-lm's KVCache does this), so a step costs the same at any N.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from rewind.bench.machine import machine_info, machine_markdown

CACHES = 20
SHAPE_HEADS, SHAPE_DIM = 4, 512
CHUNK = 256  # preallocation step, as mlx-lm's KVCache.step
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
RESULTS = Path("benchmarks/results")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                        help="cache lengths N before the timed appends")
    parser.add_argument("--concat-steps", type=int, default=16,
                        help="timed concatenate appends per length (each costs the same)")
    parser.add_argument("--prealloc-steps", type=int, default=CHUNK,
                        help="timed preallocated appends per length; one full chunk (256) includes "
                             "exactly one growth, so the figure is the amortized cost")
    parser.add_argument("--json", type=Path, default=RESULTS / "kv_append.json",
                        help="JSON output; the Markdown table goes beside it (.md)")


def _new_token(step: int) -> mx.array:
    return mx.full((1, SHAPE_HEADS, 1, SHAPE_DIM), float(step % 7), dtype=mx.bfloat16)


def time_concatenate(length: int, steps: int) -> float:
    """ms per step: every cache becomes concatenate([cache, token]) (a full copy)."""
    caches = [mx.zeros((1, SHAPE_HEADS, length, SHAPE_DIM), dtype=mx.bfloat16)
              for _ in range(CACHES)]
    mx.eval(caches)
    token = _new_token(0)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        caches = [mx.concatenate([cache, token], axis=2) for cache in caches]
        mx.eval(caches)
    elapsed = time.perf_counter() - start
    assert caches[0].shape[2] == length + steps
    return elapsed / steps * 1000


class PreallocatedCache:
    """mlx-lm KVCache's keys buffer alone: grown CHUNK positions at a time, written in place."""

    def __init__(self, length: int) -> None:
        capacity = (length + CHUNK - 1) // CHUNK * CHUNK
        self.buffer = mx.zeros((1, SHAPE_HEADS, capacity, SHAPE_DIM), dtype=mx.bfloat16)
        self.offset = length

    def append(self, token: mx.array) -> None:
        if self.offset + 1 > self.buffer.shape[2]:
            grow = mx.zeros((1, SHAPE_HEADS, CHUNK, SHAPE_DIM), dtype=mx.bfloat16)
            self.buffer = mx.concatenate([self.buffer, grow], axis=2)
        self.buffer[..., self.offset:self.offset + 1, :] = token
        self.offset += 1


def time_preallocated(length: int, steps: int) -> float:
    """ms per step: a slice update into each cache's preallocated buffer."""
    caches = [PreallocatedCache(length) for _ in range(CACHES)]
    mx.eval([cache.buffer for cache in caches])
    token = _new_token(0)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(steps):
        for cache in caches:
            cache.append(token)
        mx.eval([cache.buffer for cache in caches])
    elapsed = time.perf_counter() - start
    assert caches[0].offset == length + steps
    return elapsed / steps * 1000


def measure(lengths: list[int], concat_steps: int, prealloc_steps: int) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        time_preallocated(length, 2)  # warm-up: allocator and kernels
        concatenate_ms = time_concatenate(length, concat_steps)
        preallocated_ms = time_preallocated(length, prealloc_steps)
        rows.append({"n": length, "concatenate_ms": round(concatenate_ms, 3),
                     "preallocated_ms": round(preallocated_ms, 3),
                     "ratio": round(concatenate_ms / preallocated_ms, 1)})
        mx.clear_cache()
    return rows


def markdown(rows: list[dict[str, Any]], command: str, machine: dict[str, Any]) -> str:
    lines = [
        "# KV append: concatenate vs preallocated 256-token chunks",
        "",
        f"{CACHES} caches of [1, {SHAPE_HEADS}, N, {SHAPE_DIM}] bfloat16, one token appended per step "
        "to each; ms per step (all caches). Preallocated steps run a full 256-token chunk, so the "
        "one growth (a copy) per chunk is included, amortized as in real use.",
        "",
        f"Command: `{command}`",
        "",
        "| N | concatenate ms/step | preallocated ms/step | ratio |",
        "| ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {r['n']} | {r['concatenate_ms']:.2f} | {r['preallocated_ms']:.2f} | {r['ratio']:.1f}x |"
              for r in rows]
    lines += ["", "## Machine", "", machine_markdown(machine), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import sys

    command = "rewind bench kv-append " + " ".join(sys.argv[sys.argv.index("kv-append") + 1:]) \
        if "kv-append" in sys.argv else "rewind bench kv-append"
    rows = measure(list(args.lengths), args.concat_steps, args.prealloc_steps)
    for row in rows:
        print(f"N={row['n']:5d}  concatenate {row['concatenate_ms']:8.2f} ms/step  "
              f"preallocated {row['preallocated_ms']:6.2f} ms/step  ratio {row['ratio']:.1f}x")
    machine = machine_info()
    out: Path = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command.strip(), "caches": CACHES,
                               "shape": [1, SHAPE_HEADS, "N", SHAPE_DIM], "dtype": "bfloat16",
                               "concat_steps": args.concat_steps,
                               "prealloc_steps": args.prealloc_steps, "rows": rows, "machine": machine}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, command.strip(), machine))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
