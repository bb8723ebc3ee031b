"""The HBM-bandwidth bound on decode tokens/s: a decode step must read every weight once (the tied
embedding as the output head) and each row's KV cache (and a linear-attention layer's recurrent
state); at the card's bandwidth B that takes (weight bytes + N x state bytes) / B s, so N streams
cannot beat N / that tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rewind.bench.decode_scaling_models import FIRST_FREE_ID

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; a read probe there reached 4.58e12 (shared/GPU.md)
# Datasheet bandwidths by the name nvidia-smi gives, most specific first (an H100 80GB HBM3 is the
# SXM card). A card not listed gets the H200's, and the report names the card.
HBM_BY_GPU: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))


def hbm_card(gpu: str | None) -> str | None:
    """The entry of HBM_BY_GPU that names this card (None: not listed)."""
    return next((marker for marker, _ in HBM_BY_GPU if gpu and marker in gpu), None)


def hbm_bytes_per_s(gpu: str | None) -> float:
    card = hbm_card(gpu)
    return dict(HBM_BY_GPU)[card] if card else HBM_BYTES_PER_S


@dataclass
class StreamBytes:
    """Bytes a decode step reads: every weight once, plus per row its cache state."""

    weight_bytes: int
    kv_bytes_per_token: int  # per row, per token held (full-attention layers' K and V)
    fixed_state_bytes: int  # per row, whatever the length (linear-attention conv + recurrent)

    def step_bytes(self, rows: int, context: float) -> float:
        return self.weight_bytes + rows * (self.kv_bytes_per_token * context
                                           + self.fixed_state_bytes)

    def bound_tok_s(self, rows: int, context: float, hbm: float = HBM_BYTES_PER_S) -> float:
        return rows / (self.step_bytes(rows, context) / hbm)


def stream_bytes(loaded: Any) -> StreamBytes:
    """Weight bytes read per step (an untied input embedding is a lookup of one row per token,
    so it is left out; a tied one is the output head and counts) and the cache bytes per row,
    measured on a real cache after a short prefill."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from rewind.engine.runner import ModelRunner

    params = tree_flatten(loaded.model.parameters())
    total = sum(value.nbytes for _, value in params)
    tied = not any("lm_head" in name for name, _ in params)
    embedding = sum(value.nbytes for name, value in params if "embed_tokens" in name)
    weights = total if tied else total - embedding

    runner = ModelRunner(loaded.model)
    cache = runner.new_cache()
    length = 16
    runner.prefill(cache, list(range(FIRST_FREE_ID, FIRST_FREE_ID + length)))
    per_token = fixed = 0
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if keys is not None and hasattr(layer, "offset"):
            values = layer.values
            per_token += (keys.shape[1] * keys.shape[3] * keys.dtype.size
                          + values.shape[1] * values.shape[3] * values.dtype.size)
        else:
            fixed += sum(a.nbytes for a in layer.state if isinstance(a, mx.array))
    return StreamBytes(int(weights), int(per_token), int(fixed))
