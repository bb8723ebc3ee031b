"""Run Rewind's CUDA decode kernels once each, small, for compute-sanitizer:

    compute-sanitizer --tool racecheck python benchmarks/probes/sanitize_cuda_kernels.py
    compute-sanitizer --tool memcheck python benchmarks/probes/sanitize_cuda_kernels.py

- rewind.kernels.cuda_block: the load-time check of a tiny Llama's block (q/k/v with RoPE, a
  product with the residual add, gate/up with the MLP's gate, and rewind.kernels.cuda_attention
  over 300, 301 and 4,097 keys: one span and several, and the spans' combine);
- rewind.kernels.cuda_skinny: products of 2 to 32 rows, every tile count, a last tile of W rows
  cut short, `tiling_for`'s choices and each kind of tiling (wider W tiles, 16 warps, K split
  over blocks with the join kernel, streamed W loads).

Prints what each check found (None: the fused block gave mlx-lm's bits).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from mlx_lm.utils import load_model  # noqa: E402

from rewind.kernels import cuda_block, cuda_skinny  # noqa: E402
from rewind.models import fused_projections  # noqa: E402
from rewind.testing.tiny_models import build_tiny_model  # noqa: E402


def main() -> int:
    if not cuda_skinny.available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:  # MLX reads the weights when first used
        model, _ = load_model(build_tiny_model("llama", Path(folder), dtype="bfloat16"))
        fused_projections.use_in_model(model)
        block = model.layers[0]
        print("cuda_block check:",
              cuda_block._same_as_plain(block, cuda_block.block_shape(block)), flush=True)
    tilings = {"tiling_for": None, "default": cuda_skinny.Tiling(),
               "2 W tiles": cuda_skinny.Tiling(w_tiles=2, unroll=2),
               "16 warps": cuda_skinny.Tiling(warps=16, unroll=2),
               "K over 8 blocks": cuda_skinny.Tiling(w_tiles=4, unroll=2, split=8),
               "K over 3 blocks, streamed W": cuda_skinny.Tiling(w_tiles=2, split=3,
                                                                 stream_w=True)}
    for name, tiling in tilings.items():
        worst = 0.0
        for n, k in ((40, 96), (3072, 256), (64, 512)):
            w = (mx.random.normal((n, k)) * 0.05).astype(mx.bfloat16)
            for rows in (2, 9, 17, 32):
                if tiling is not None and not cuda_skinny.fits(tiling, rows):
                    continue
                x = mx.random.normal((rows, k)).astype(mx.bfloat16)
                exact = x.astype(mx.float32) @ w.astype(mx.float32).T
                ours = cuda_skinny.matmul(x, w, tiling).astype(mx.float32)
                worst = max(worst, mx.max(mx.abs(ours - exact)).item())
        print(f"cuda_skinny, {name}: largest difference from float32 {worst:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
