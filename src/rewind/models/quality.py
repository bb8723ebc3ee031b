"""Perplexity of a model on a text: the check that a conversion gave a working model, not noise."""

from __future__ import annotations

import math
from typing import Any


def token_log_likelihoods(model: Any, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i >= 1, computed in one forward pass (float32 softmax)."""
    import mlx.core as mx

    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    inputs = mx.array(tokens[:-1])[None]
    targets = mx.array(tokens[1:])
    logits = model(inputs)[0].astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
    return picked.tolist()


def perplexity(model: Any, tokenizer: Any, text: str) -> float:
    """exp of the mean negative log-likelihood of the text's tokens (BOS included as context)."""
    tokens = tokenizer.encode(text)
    log_likelihoods = token_log_likelihoods(model, tokens)
    return math.exp(-sum(log_likelihoods) / len(log_likelihoods))


def compute_in_float32(model: Any) -> Any:
    """Dequantize and cast to float32, as rewind's loader does on CPU (only float32 matmuls reach
    OpenBLAS): the stored form's rounding stays, the activation dtype no longer differs per form."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    model.update(tree_map(lambda value: value.astype(mx.float32)
                          if mx.issubdtype(value.dtype, mx.floating) else value, model.parameters()))
    mx.eval(model.parameters())
    return model
