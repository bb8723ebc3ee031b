"""Model steps for the engine: advance a cache without logits, or get the last position's logits.

Computing the 262k-word output projection for every prompt position, when only the last one is
sampled, is most of a prefill's cost on small models (Gemma 3 270M: 168M of its 270M parameters
are the tied output projection). These functions run the model's backbone (embeddings + layers +
final norm) on all positions and its output head on the last position only.

mlx-lm model classes do not expose that split, so `split_model` (rewind.kernels.model_split)
knows the families whose `Model.__call__` is exactly "backbone, then head" and returns None for
others; those fall back to the full model call (correct, just slower).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from rewind.kernels.backend import kernels_for
from rewind.kernels.model_split import split_model


def hidden_states(model: Any, tokens: mx.array, cache: list[Any]) -> mx.array | None:
    """Backbone output [B, T, H] for tokens [B, T], or None for a family without a known split."""
    split = split_model(model)
    return None if split is None else split.backbone(tokens, cache=cache)


def _embedding_kwargs(input_embeddings: mx.array | None) -> dict[str, Any]:
    # Image prompts (rewind.vision) hand embeddings [B, T, H] in place of the token ids; mlx-lm's
    # models take them as `input_embeddings` and ignore the ids then.
    return {} if input_embeddings is None else {"input_embeddings": input_embeddings}


def prefill(model: Any, tokens: mx.array, cache: list[Any],
            input_embeddings: mx.array | None = None) -> None:
    """Run tokens [B, T] through the model to fill `cache`; no logits are computed.

    Only the cache state is evaluated: MLX is lazy, so the final norm of the unused hidden states
    never runs either.
    """
    split = split_model(model)
    kwargs = _embedding_kwargs(input_embeddings)
    if split is None:
        model(tokens, cache=cache, **kwargs)
    else:
        split.backbone(tokens, cache=cache, **kwargs)
    mx.eval([c.state for c in cache])


def last_logits(model: Any, tokens: mx.array, cache: list[Any],
                input_embeddings: mx.array | None = None) -> mx.array:
    """Logits [B, vocab] of the last position of tokens [B, T].

    Lazy with MLX's head; with a CPU fast head (rewind.kernels.fast_head) the backbone is
    evaluated here and the logits come back materialized. On the CPU the backbone itself may be
    Rewind's C kernels (rewind.kernels.native_forward), installed by the loader.
    """
    split = split_model(model)
    kwargs = _embedding_kwargs(input_embeddings)
    if split is None:
        return model(tokens, cache=cache, **kwargs)[:, -1, :]
    hidden = split.backbone(tokens, cache=cache, **kwargs)
    # The loader's CPU head (bf16/int8 weights read by a C kernel) when one is installed.
    return split.logits(hidden[:, -1, :], kernels_for(model).head)
