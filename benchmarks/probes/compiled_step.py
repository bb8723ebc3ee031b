"""A decode step built once and replayed: what a fixed-shape, mx.compile'd step would save over
mlx-lm's step, before the engine is changed for it (issue 27).

mlx-lm's KV cache hands attention a slice of its buffer that grows by one key a step, and takes
the write position as a Python integer, so every step is a new graph of new shapes: the model's
Python builds it again (~350 ops for a 16-layer Llama) and MLX encodes it again. Here the cache
is a buffer of fixed capacity with the write position and each row's first key in device arrays
(mx.slice_update at an array index, RoPE at an array offset, attention over [start, length) by
rewind.kernels.cuda_attention on CUDA, a masked MLX attention elsewhere). Every step of one batch
size then has the same shapes, so mx.compile traces it once, replays the trace after that, and
fuses its elementwise chains.

Modes, same random-weight bf16 model, same rows (each row's own length: left-padded):
  mlx-lm    mlx-lm's step (a BatchKVCache, its mask), mx.async_eval one step ahead
  static    the fixed-shape step, not compiled
  compiled  the fixed-shape step under mx.compile
Per mode: the time to build the step's graph, the time mx.async_eval takes to return, the step's
wall time, tokens/s, and how many of the greedy tokens equal mlx-lm's (bf16: a different sum order
may flip a near tie on random weights). --check runs a float32 tiny model and fails unless the
three modes give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
# the same random shapes as MLX's minimal reproduction beside this file
from mlx_step_host_cost import LLAMA_1B, TINY


class FixedCache:
    """One layer's keys and values in buffers of fixed capacity; `length` (one int32) is the next
    slot to write, `starts` [B] each row's first key. All device arrays: no Python integer in
    the step's graph."""

    def __init__(self, keys: mx.array, values: mx.array, starts: mx.array, length: mx.array):
        self.keys, self.values, self.starts, self.length = keys, values, starts, length

    @property
    def offset(self) -> mx.array:  # each row's position of the new token, for RoPE
        return self.length - self.starts

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.length, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.length, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, **_: Any) -> None:
        return None  # the attention below reads starts and length itself


def fixed_attention(original: Any, use_kernel: bool) -> Any:
    from rewind.kernels import cuda_attention

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if not isinstance(cache, FixedCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                            sinks=sinks)
        filled = cache.length + 1
        if use_kernel:
            return cuda_attention.decode_attention(queries, keys, values, filled, cache.starts,
                                                   scale)
        slots = mx.arange(keys.shape[2])
        allowed = (slots[None] >= cache.starts[:, None]) & (slots[None] < filled)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=allowed[:, None, None, :])
    return attention


def build(tiny: bool, dtype: Any) -> Any:
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(TINY if tiny else LLAMA_1B))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def prefill(model: Any, prompt_lengths: list[int]) -> tuple[list[Any], mx.array]:
    """Each row's prompt through its own cache, merged the way mlx-lm batches rows."""
    from mlx_lm.models import cache as cache_lib

    rows, first = [], []
    for index, length in enumerate(prompt_lengths):
        cache = cache_lib.make_prompt_cache(model)
        tokens = mx.random.randint(0, 4000, (1, length), key=mx.random.key(index))
        logits = model(tokens, cache=cache)
        first.append(mx.argmax(logits[:, -1, :], axis=-1))
        mx.eval(first[-1], [c.state for c in cache])
        rows.append(cache)
    layers = [cache_lib.BatchKVCache.merge([row[i] for row in rows]) for i in range(len(rows[0]))]
    return layers, mx.concatenate(first)


def run_mlx_lm(model: Any, lengths: list[int], steps: int) -> tuple[dict, list[list[int]]]:
    caches, y = prefill(model, lengths)

    def step(tokens):
        logits = model(tokens[:, None], cache=caches)
        return mx.argmax(logits[:, -1, :], axis=-1)
    return timed(step, y, steps)


def run_fixed(model: Any, lengths: list[int], steps: int, compiled: bool,
              capacity: int) -> tuple[dict, list[list[int]]]:
    caches, y = prefill(model, lengths)
    length = caches[0]._idx
    starts = caches[0].left_padding.astype(mx.int32)
    buffers: list[mx.array] = []
    for cache in caches:
        for buffer in (cache.keys, cache.values):
            grown = mx.zeros((*buffer.shape[:2], capacity, buffer.shape[3]), buffer.dtype)
            buffers.append(mx.slice_update(grown, buffer[..., :length, :], mx.array([0]), (2,)))
    mx.eval(buffers)
    state = {"length": mx.array([length], mx.int32), "buffers": buffers}
    del caches

    def forward(tokens, starts, length, *buffers):
        layer_caches = [FixedCache(buffers[i], buffers[i + 1], starts, length)
                        for i in range(0, len(buffers), 2)]
        logits = model(tokens[:, None], cache=layer_caches)
        out = [mx.argmax(logits[:, -1, :], axis=-1), length + 1]
        for cache in layer_caches:
            out += [cache.keys, cache.values]
        return out
    forward_fn = mx.compile(forward) if compiled else forward

    def step(tokens):
        buffers, state["buffers"] = state["buffers"], None  # the step owns them: written in place
        out = forward_fn(tokens, starts, state["length"], *buffers)
        del buffers
        state["length"], state["buffers"] = out[1], out[2:]
        return out[0]
    return timed(step, y, steps)


def timed(step: Any, y: mx.array, steps: int) -> tuple[dict, list[list[int]]]:
    build_s = dispatch_s = 0.0
    walls: list[float] = []
    tokens: list[list[int]] = []
    warm = 8
    for index in range(steps + warm):
        start = time.perf_counter()
        next_y = step(y)
        built = time.perf_counter()
        mx.async_eval(next_y)
        queued = time.perf_counter()
        tokens.append(y.tolist())  # the previous step's tokens, read while this one runs
        y = next_y
        end = time.perf_counter()
        if index >= warm:
            build_s += built - start
            dispatch_s += queued - built
            walls.append(end - start)
    tokens.append(y.tolist())
    walls.sort()
    batch = len(tokens[0])
    return ({"build_ms": 1e3 * build_s / steps, "async_eval_ms": 1e3 * dispatch_s / steps,
             "wall_ms_median": 1e3 * walls[len(walls) // 2],
             "tok_s": batch * len(walls) / sum(walls)}, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/compiled_step.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--modes", nargs="+", default=["mlx-lm", "static", "compiled"])
    parser.add_argument("--check", action="store_true",
                        help="a float32 4-layer model; fails on any token unlike mlx-lm's")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from mlx_lm.models import base, llama

    from rewind.kernels import cuda_attention

    use_kernel = cuda_attention.available()
    llama.scaled_dot_product_attention = fixed_attention(base.scaled_dot_product_attention,
                                                         use_kernel)
    model = build(args.check, mx.float32 if args.check else mx.bfloat16)
    rows = []
    for batch in args.batches:
        # rows of mixed lengths, as a serving batch has: up to 255 tokens shorter than the longest
        spread = max(1, min(256, args.prompt_tokens // 2))
        lengths = [args.prompt_tokens - (37 * row) % spread for row in range(batch)]
        capacity = -(-(args.prompt_tokens + args.steps + 16) // 256) * 256
        reference: list[list[int]] | None = None
        for mode in args.modes:
            if mode == "mlx-lm":
                figures, tokens = run_mlx_lm(model, lengths, args.steps)
            else:
                figures, tokens = run_fixed(model, lengths, args.steps, mode == "compiled",
                                            capacity)
            reference = reference if reference is not None else tokens
            same = sum(a == b for ra, rb in zip(reference, tokens) for a, b in zip(ra, rb))
            row = {"mode": mode, "batch": batch, **figures, "same_tokens": same,
                   "tokens": sum(len(r) for r in tokens), "kernel": use_kernel and mode != "mlx-lm",
                   "device": str(mx.default_device()), "mlx": mx.__version__}
            rows.append(row)
            print(f"B={batch:<3} {mode:<9} build {row['build_ms']:.2f} ms  async_eval "
                  f"{row['async_eval_ms']:.2f} ms  step {row['wall_ms_median']:.2f} ms  "
                  f"{row['tok_s']:.0f} tok/s  same tokens {same}/{row['tokens']}", flush=True)
            if args.check and same != row["tokens"]:
                raise SystemExit(f"{mode} at B={batch}: {same} of {row['tokens']} tokens equal")
            mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
