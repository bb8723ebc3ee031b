"""Random inputs of the gated delta rule in mlx-lm's shapes, for the CPU and CUDA kernel tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def inputs(batch: int, steps: int, key_heads: int, value_heads: int, key_dim: int,
           value_dim: int, per_key_gate: bool, seed: int) -> dict[str, mx.array]:
    """q, k [B, T, Hk, Dk] (scaled as normalize_qk leaves them), v [B, T, Hv, Dv], gates in
    [0.5, 1), beta in [0, 1), and a random starting state [B, Hv, Dv, Dk]."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    gate_shape = ((batch, steps, value_heads, key_dim) if per_key_gate
                  else (batch, steps, value_heads))
    return {"q": normal(batch, steps, key_heads, key_dim, scale=key_dim ** -0.5),
            "k": normal(batch, steps, key_heads, key_dim, scale=key_dim ** -0.5),
            "v": normal(batch, steps, value_heads, value_dim),
            "g": mx.array(rng.uniform(0.5, 1.0, gate_shape).astype(np.float32)),
            "beta": mx.array(rng.uniform(0.0, 1.0, (batch, steps, value_heads))
                             .astype(np.float32)),
            "state": normal(batch, value_heads, value_dim, key_dim)}
