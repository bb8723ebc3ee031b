"""Model steps for the engine: advance a cache without logits, or get the last position's logits.

Computing the 262k-word output projection for every prompt position, when only the last one is
sampled, is most of a prefill's cost on small models; these functions avoid it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def prefill(model: Any, tokens: mx.array, cache: list[Any]) -> None:
    """Run tokens [B, T] through the model to fill `cache`; no logits are computed."""
    model(tokens, cache=cache)
    mx.eval([c.state for c in cache])


def last_logits(model: Any, tokens: mx.array, cache: list[Any]) -> mx.array:
    """Logits [B, vocab] of the last position of tokens [B, T]."""
    return model(tokens, cache=cache)[:, -1, :]
