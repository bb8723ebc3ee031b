"""What a prompt-cache restore costs for a Llama-3.2-1B-shaped KV cache (16 layers, 8 key-value
heads of 64), on whatever device MLX has: the engine restores a waiting turn's prefix inside a
step, so on a GPU the other sessions' tokens wait for it.

A random model with Llama-3.2-1B's KV layout but a narrow body (the restore copies KV rows only)
fills a RAM-only prompt cache with checkpoints every 256 tokens; then restores of several
lengths are timed (median of five), as the engine calls it and through both of
rewind.cache.records.rebuild's ways: one copy per block record, layer and keys/values, or the
records' stacked rows joined in one concatenation (what a GPU restore does; on a CPU each layer
is then copied again at its first write, not timed here).

    PYTHONPATH=src python benchmarks/probes/restore_cost.py [--lengths 2048,5120,9216]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def main() -> int:
    from rewind.cache.kv import make_cache
    from rewind.cache.prompt_cache import PromptCache
    from rewind.cache.records import rebuild
    from rewind.config import CacheConfig
    from rewind.models.loader import load_model
    from rewind.testing.tiny_models import build_tiny_model

    parser = argparse.ArgumentParser(prog="python benchmarks/probes/restore_cost.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,5120,9216")
    args = parser.parse_args()
    lengths = sorted(int(n) for n in args.lengths.split(","))
    folder = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "kv-1b", overrides={
        "num_hidden_layers": 16, "num_key_value_heads": 8, "num_attention_heads": 8,
        "head_dim": 64, "hidden_size": 512, "intermediate_size": 256})
    loaded = load_model(str(folder), native_forward="off")
    model = loaded.model
    total = lengths[-1]
    tokens = [(i * 7919) % 200 + 5 for i in range(total)]
    cache_config = CacheConfig(disk_enabled=False, ram_bytes=16 << 30)
    prompt_cache = PromptCache(model, loaded.fingerprint, cache_config)
    cache = make_cache(model)
    for start in range(0, total, 256):
        chunk = tokens[start:start + 256]
        model(mx.array([chunk]), cache=cache)
        mx.eval([layer.state for layer in cache])
        prompt_cache.checkpoint(tokens[:start + len(chunk)], cache)
    layer = cache[0]
    row_bytes = 2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.dtype.size
    print(f"device {mx.default_device()}, mlx {mx.__version__}, KV {layer.keys.dtype}, "
          f"{len(cache)} layers, {row_bytes * len(cache)} bytes a token")
    print("| restore | tokens restored | blocks | copies | MB | median ms | min ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length in lengths:
        prompt = tokens[:length] + [1, 2, 3]
        restored = prompt_cache.restore(prompt).tokens
        blocks = -(-restored // 256)
        megabytes = restored * row_bytes * len(cache) / 1e6
        # prompt_cache.restore as the engine calls it (joined on a GPU), then both rebuilds
        # directly from the same records (rewind.cache.records.rebuild)
        parts = _parts(prompt_cache, prompt)
        ways = {"as served": lambda: prompt_cache.restore(prompt).cache,
                "per layer": lambda: rebuild(make_cache(model), parts),
                "joined": lambda: rebuild(make_cache(model), parts, joined=True)}
        copies = {"as served": None, "per layer": 2 * len(cache) * (blocks + 1),
                  "joined": blocks + 1}
        for way, call in ways.items():
            times = []
            for _ in range(6):
                started = time.perf_counter()
                mx.eval([layer.state for layer in call()])
                times.append(time.perf_counter() - started)
            times = times[1:]  # the first builds kernels for the shapes
            print(f"| {way} | {restored} | {blocks} | {copies[way] or ''} | {megabytes:.0f} | "
                  f"{statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f} |")
    return 0


def _parts(prompt_cache, prompt):
    """The records a restore of `prompt` reads (the prompt cache's own plan and load)."""
    from rewind.cache.blocks import BlockChain
    from rewind.cache.kv import make_cache

    template = make_cache(prompt_cache.model)
    chain = BlockChain(prompt, prompt_cache._root(template, None), None, prompt_cache.block_tokens)
    point = prompt_cache._plan(chain, len(prompt) - 1, set(), template)
    return prompt_cache._load(point, set(), None, template)[0]


if __name__ == "__main__":
    sys.exit(main())
