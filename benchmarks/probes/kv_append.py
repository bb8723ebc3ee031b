"""KV append: what one appended token costs in Rewind's KV cache and in mlx-lm's, at N tokens.

20 caches (layers) of [1, 4, N, 512] bfloat16 keys and values each receive one token per step
through the caches' own `update_and_fetch`, as a decode step does:

- mlx-lm's KVCache grows its buffer 256 positions at a time, each growth a copy of the whole
  buffer: one step in 256 copies N rows, so the amortized cost of a token grows with N.
- Rewind's GrowingKVCache (rewind.cache.kv) grows along a geometric ladder of capacities
  (rewind.cache.capacity: ..., 4096, 6144, 8192, 12288, ...): one copy of N rows per N/3 to N/2
  appended tokens, so the amortized cost is the same at any N.

A growth happens once per period (256 tokens for mlx-lm's; N/2 for Rewind's at N, a power of
two times 256, whose next rung is 1.5 N), so each class is timed over one whole period starting
from the state it is in when it holds exactly N tokens after growing its own way (full: the
first append grows): the figure is the amortized cost, growth included, as in real use. The two
classes run side by side per N in one process. `concatenate` (a full copy every step, as a naive
cache does) can be added.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from rewind.bench.machine import machine_info, machine_markdown
from rewind.cache.kv import STEP, GrowingKVCache

CACHES = 20
SHAPE_HEADS, SHAPE_DIM = 4, 512
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
RESULTS = Path("benchmarks/results")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS),
                        help="cache lengths N (multiples of 256) before the timed appends")
    parser.add_argument("--concat-steps", type=int, default=0,
                        help="also time a cache that concatenates every step, over this many "
                             "steps per length (0: not measured; each step costs the same)")
    parser.add_argument("--json", type=Path, default=RESULTS / "kv_append.json",
                        help="JSON output; the Markdown table goes beside it (.md)")


def _token(dtype: Any = mx.bfloat16) -> mx.array:
    return mx.full((1, SHAPE_HEADS, 1, SHAPE_DIM), 1.0, dtype=dtype)


def _full_cache(cls: Callable[[], Any], length: int) -> Any:
    """A cache of class `cls` holding `length` tokens in the buffer its own growth gives it when
    the last of them arrived: a buffer of exactly `length` rows (full), for both classes when
    `length` is a multiple of 256 (mlx-lm's) or a rung of the ladder (Rewind's)."""
    cache = cls()
    rows = mx.zeros((1, SHAPE_HEADS, length, SHAPE_DIM), dtype=mx.bfloat16)
    cache.update_and_fetch(rows, rows)
    mx.eval(cache.keys, cache.values)
    return cache


def period(cls: Callable[[], Any], length: int) -> int:
    """Appends from `length` until the class's next growth after the first: the span over which
    one growth is amortized."""
    cache = _full_cache(cls, length)
    cache.update_and_fetch(_token(), _token())  # the first append grows
    return cache.keys.shape[2] - length


def time_class(cls: Callable[[], Any], length: int) -> tuple[float, int]:
    """(ms per appended token, appends timed): one whole period of appends to CACHES caches."""
    caches = [_full_cache(cls, length) for _ in range(CACHES)]
    token = _token()
    mx.eval(token)
    steps = period(cls, length)
    start = time.perf_counter()
    for _ in range(steps):
        for cache in caches:
            cache.update_and_fetch(token, token)
        mx.eval([(cache.keys, cache.values) for cache in caches])
    elapsed = time.perf_counter() - start
    assert caches[0].offset == length + steps
    return elapsed / steps * 1000, steps


def time_concatenate(length: int, steps: int) -> float:
    """ms per step: every cache becomes concatenate([cache, token]) (a full copy)."""
    caches = [mx.zeros((1, SHAPE_HEADS, length, SHAPE_DIM), dtype=mx.bfloat16)
              for _ in range(2 * CACHES)]  # keys and values
    token = _token()
    mx.eval(caches, token)
    start = time.perf_counter()
    for _ in range(steps):
        caches = [mx.concatenate([cache, token], axis=2) for cache in caches]
        mx.eval(caches)
    return (time.perf_counter() - start) / steps * 1000


def measure(lengths: list[int], concat_steps: int) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        if length % STEP:
            raise ValueError(f"--lengths: {length} is not a multiple of {STEP}")
        time_class(GrowingKVCache, STEP)  # warm-up: allocator and kernels
        mlx_ms, mlx_steps = time_class(KVCache, length)
        mx.clear_cache()
        rewind_ms, rewind_steps = time_class(GrowingKVCache, length)
        mx.clear_cache()
        row = {"n": length, "mlx_lm_ms": round(mlx_ms, 3), "mlx_lm_steps": mlx_steps,
               "rewind_ms": round(rewind_ms, 3), "rewind_steps": rewind_steps,
               "ratio": round(mlx_ms / rewind_ms, 2)}
        if concat_steps:
            row["concatenate_ms"] = round(time_concatenate(length, concat_steps), 3)
            mx.clear_cache()
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], command: str, machine: dict[str, Any]) -> str:
    concat = any("concatenate_ms" in r for r in rows)
    lines = [
        "# KV append: Rewind's GrowingKVCache against mlx-lm's KVCache",
        "",
        f"{CACHES} caches (layers) of [1, {SHAPE_HEADS}, N, {SHAPE_DIM}] bfloat16 keys and values, "
        "one token appended per step to each through the cache's own `update_and_fetch`; ms per "
        "step (all caches), measured side by side in one process. Each class starts full at N (its "
        "next append grows, as it would after growing its own way to N) and is timed over one "
        "whole growth period, so its one growth (a copy of the buffer) is included, amortized as "
        "in real use: 256 appends for mlx-lm's (it grows 256 rows at a time), N/2 for Rewind's "
        "(from N = 2^k x 256 its next capacity is 1.5 N).",
        "",
        f"Command: `{command}`",
        "",
        "| N | mlx-lm KVCache ms/step | Rewind GrowingKVCache ms/step | mlx-lm / Rewind |"
        + (" concatenate ms/step |" if concat else ""),
        "| ---: | ---: | ---: | ---: |" + (" ---: |" if concat else ""),
    ]
    for r in rows:
        line = f"| {r['n']} | {r['mlx_lm_ms']:.2f} | {r['rewind_ms']:.2f} | {r['ratio']:.1f}x |"
        if concat:
            line += f" {r['concatenate_ms']:.2f} |" if "concatenate_ms" in r else " |"
        lines.append(line)
    lines += ["", "## Machine", "", machine_markdown(machine), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    command = "python benchmarks/probes/kv_append.py " + " ".join(sys.argv[1:])
    rows = measure(list(args.lengths), args.concat_steps)
    for row in rows:
        print(f"N={row['n']:5d}  mlx-lm KVCache {row['mlx_lm_ms']:7.2f} ms/step "
              f"({row['mlx_lm_steps']} steps)  Rewind GrowingKVCache {row['rewind_ms']:7.2f} ms/step "
              f"({row['rewind_steps']} steps)  ratio {row['ratio']:.1f}x"
              + (f"  concatenate {row['concatenate_ms']:.2f}" if "concatenate_ms" in row else ""))
    machine = machine_info()
    out: Path = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command.strip(), "caches": CACHES,
                               "shape": [1, SHAPE_HEADS, "N", SHAPE_DIM], "dtype": "bfloat16",
                               "rows": rows, "machine": machine}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, command.strip(), machine))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/kv_append.py",
                                     description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv)) or 0


if __name__ == "__main__":
    sys.exit(main())
