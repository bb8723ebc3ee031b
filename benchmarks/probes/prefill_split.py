"""Where a prefill's time goes on the CPU kernels: one prompt through the default model (or any
`rewind` model name), with the C entry points (layer_pre: norm + q/k/v; attention; layer_post:
o + MLP; the head's matvec) timed from the Python boundary. Prints a markdown table, rounds in
turn. REWIND_NO_AMX=1 runs the same without AMX tiles.

    python benchmarks/probes/prefill_split.py --tokens 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any, Callable

ENTRY_POINTS = ("layer_pre", "attention", "layer_post", "matvec", "rows_rms_norm",
                "dequantize_rows")


def timed_kernels(times: dict[str, float]) -> None:
    """Wraps the boundary's entry points so each call's time adds to times[name]."""
    from rewind.kernels import boundary

    for name in ENTRY_POINTS:
        original: Callable[..., Any] = getattr(boundary.Kernels, name)

        def wrapper(self: Any, *args: Any, _original: Callable[..., Any] = original,
                    _name: str = name, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                times[_name] += time.perf_counter() - start

        setattr(boundary.Kernels, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/prefill_split.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from rewind.bench.speed import prompt_tokens
    from rewind.cache.kv import make_cache
    from rewind.engine.single import generate_tokens
    from rewind.kernels import boundary, native
    from rewind.models.loader import load_model

    times: dict[str, float] = collections.defaultdict(float)
    timed_kernels(times)
    model = load_model(args.model).model
    tokens = prompt_tokens(args.tokens, 262144)
    for _ in generate_tokens(model, tokens[:64], max_tokens=2):  # warm-up: build, allocator
        pass
    library = boundary.kernels()
    amx = library is not None and library.uses_amx
    print(f"kernels: {native.chosen_isa()}, AMX {'on' if amx else 'off'}; "
          f"{args.tokens}-token prompt, one sequence\n")
    print("| round | prefill s | tok/s | layer_pre s | attention s | layer_post s | head s | rest s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for round_ in range(1, args.rounds + 1):
        times.clear()
        stream = generate_tokens(model, tokens, cache=make_cache(model), max_tokens=1)
        start = time.perf_counter()
        next(stream)
        total = time.perf_counter() - start
        parts = [times["layer_pre"], times["attention"], times["layer_post"], times["matvec"]]
        print(f"| {round_} | {total:.3f} | {args.tokens / total:.0f} | "
              + " | ".join(f"{p:.3f}" for p in parts) + f" | {total - sum(parts):.3f} |")


if __name__ == "__main__":
    main()
