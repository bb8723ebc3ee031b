"""On an NVIDIA GPU: does a decode step's attention take MLX's fused cuDNN path for each cache?

MLX's CUDA backend (scaled_dot_product_attention.cpp, `use_cudnn_for_decoding`) takes cuDNN for
a one-token query only when the keys and values are a slice [..., :n, :] from the start of one
contiguous buffer whose capacity is a multiple of 256, and when no array mask is given; else it
runs its vector kernel. This runs one decode step's attention per case, each in a fresh process
with cuDNN's API log on, and counts cuDNN's execute calls: cuDNN is used by nothing else here,
so any means the fused path was taken.

Cases: Rewind's GrowingKVCache fresh (past a growth), restored from prompt-cache records
(rewind.cache.records.rebuild), merged into a batch (GrowingBatchKVCache; with mlx-lm's array
mask and without one), and extracted from a batch; mlx-lm's KVCache on and off the 256 grid and
its extract, as controls that show the count tells the two paths apart.

    PYTHONPATH=src python3 scripts/cuda_kv_layout_check.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HEADS, KV_HEADS, DIM = 32, 8, 64  # Llama-3.2-1B's attention shape

CASES = {
    "growing_fresh": "Rewind GrowingKVCache, 1000-token prefill + 40 decode rows (grown to 1536)",
    "growing_restored": "Rewind GrowingKVCache rebuilt from prompt-cache records at 600 tokens",
    "growing_merged_masked": "GrowingBatchKVCache of 2 rows (600, 300), mlx-lm's array mask",
    "growing_merged_unmasked": "GrowingBatchKVCache of 2 equal rows (600, 600), no mask",
    "growing_extracted": "a row extracted from a GrowingBatchKVCache",
    "mlx_on_grid": "mlx-lm KVCache, chunks 512 + 512 + 17 rows (capacity 1280)",
    "mlx_off_grid": "mlx-lm KVCache, chunks 300 + 300 (capacity 812: off the 256 grid)",
    "mlx_extracted": "a row extracted from mlx-lm's BatchKVCache (exact-size buffer)",
}


def _rows(n: int, batch: int = 1):
    import mlx.core as mx

    return (mx.random.normal((batch, KV_HEADS, n, DIM)).astype(mx.bfloat16),
            mx.random.normal((batch, KV_HEADS, n, DIM)).astype(mx.bfloat16))


def _filled(cls, chunks):
    import mlx.core as mx

    cache = cls()
    for n in chunks:
        cache.update_and_fetch(*_rows(n))
    mx.eval(cache.keys, cache.values)
    return cache


def _restored():
    from rewind.cache import records as rec
    from rewind.cache.blocks import BlockChain, root_key
    from rewind.cache.kv import GrowingKVCache

    live = [_filled(GrowingKVCache, (512, 88))]
    tokens = list(range(600))
    chain = BlockChain(tokens, root_key("check", "layout"))
    blocks = [*chain.full, chain.at(600)]
    parts = rec.RestoreParts(end=600, kv=[rec.snapshot_kv(live, b, "x") for b in blocks], state=None)
    return rec.rebuild([GrowingKVCache()], parts)[0]


def _setup(case: str):
    """(cache, mask) just before the decode step."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from rewind.cache.kv import GrowingKVCache

    if case == "growing_fresh":
        return _filled(GrowingKVCache, (512, 488) + (1,) * 40), None
    if case == "growing_restored":
        return _restored(), None
    if case.startswith("growing_merged"):
        lengths = (600, 300) if case.endswith("masked") and "unmasked" not in case else (600, 600)
        batch = GrowingKVCache.merge([_filled(GrowingKVCache, (n,)) for n in lengths])
        return batch, (batch.make_mask(1) if "unmasked" not in case else None)
    if case == "growing_extracted":
        batch = GrowingKVCache.merge([_filled(GrowingKVCache, (n,)) for n in (600, 300)])
        return batch.extract(1), None
    if case == "mlx_on_grid":
        return _filled(KVCache, (512, 512) + (1,) * 17), None
    if case == "mlx_off_grid":
        return _filled(KVCache, (300, 300)), None
    if case == "mlx_extracted":
        batch = BatchKVCache.merge([_filled(KVCache, (n,)) for n in (600, 300)])
        return batch.extract(1), None
    raise ValueError(case)


def run_case(case: str) -> None:
    import mlx.core as mx

    cache, mask = _setup(case)
    batch = cache.keys.shape[0]
    queries = mx.random.normal((batch, HEADS, 1, DIM)).astype(mx.bfloat16)
    keys, values = cache.update_and_fetch(*_rows(1, batch))
    mx.eval(queries, keys, values, *([] if mask is None else [mask]))
    print(f"capacity {cache.keys.shape[2]}, live rows {keys.shape[2]}", flush=True)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=DIM ** -0.5, mask=mask)
    mx.eval(out)
    mx.synchronize()


def main() -> int:
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return 0
    import mlx.core as mx

    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    failures, shown = 0, False
    for case, what in CASES.items():
        with tempfile.TemporaryDirectory() as folder:
            log = Path(folder) / "cudnn.log"
            env = dict(os.environ, CUDNN_LOGLEVEL_DBG="3", CUDNN_LOGDEST_DBG=str(log))
            result = subprocess.run([sys.executable, __file__, case], env=env,
                                    capture_output=True, text=True, timeout=300)
            text = log.read_text(errors="replace") if log.exists() else ""
        calls = re.findall(r"(cudnn\w+)\(\) called", text)
        executes = sum("Execute" in name or "CudaGraph" in name for name in calls)
        if result.returncode != 0:
            failures += 1
            print(f"{case}: FAILED\n{result.stderr[-2000:]}")
            continue
        print(f"{case:24s} {'cuDNN ' if executes else 'vector'}  cudnn calls {len(calls):4d}, "
              f"execute/graph {executes:3d}  {result.stdout.strip()}  ({what})")
        if calls and not shown:
            shown = True
            print("  cuDNN functions seen:", sorted(set(calls)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
