"""Model steps for the engine: advance a cache without logits, or get the last position's logits.

Computing the 262k-word output projection for every prompt position, when only the last one is
sampled, is most of a prefill's cost on small models (Gemma 3 270M: 168M of its 270M parameters
are the tied output projection). These functions run the model's backbone (embeddings + layers +
final norm) on all positions and its output head on the last position only.

mlx-lm model classes do not expose that split, so `split_model` knows the families whose
`Model.__call__` is exactly "backbone, then head" and returns None for others; those fall back to
the full model call (correct, just slower).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from rewind.kernels.backend import ObjectTable, kernels_for

# model_type values whose top-level __call__ is `self.model(...)` followed by the output head
# (tied embedding `as_linear` or `lm_head`) and nothing else (no soft-capping, no logit scale).
# Checked against mlx-lm 0.32's model files; add a family only after reading its Model.__call__.
# "mistral" is mlx-lm's llama class under another name (Mistral text models, and the language
# model of Pixtral and Mistral 3 vision folders); "ministral3" is Ministral 3's. Qwen3-VL's
# language model is mlx-lm's qwen3 (qwen3_moe for qwen3_vl_moe) under its text config's type.
# Qwen 3.5's language model takes its text config's type ("qwen3_5_text", "qwen3_5_moe_text") in
# folders that nest one, the folder's in flat ones.
_BACKBONE_THEN_HEAD = frozenset({"llama", "mistral", "ministral3", "qwen2", "qwen3",
                                 "gemma3_text", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                 "qwen3_5_moe_text", "qwen3_vl", "qwen3_vl_text",
                                 "qwen3_vl_moe_text", "qwen3_moe", "qwen3_next", "olmo2",
                                 "smollm3", "phi3", "glm4"})
# Families whose __call__ is backbone, head, then final soft-capping of the logits,
# cap * tanh(logits / cap), with the cap in the Model's `final_logit_softcapping` (Gemma 2 and
# Gemma 4, read in mlx-lm 0.32's gemma2.py and gemma4_text.py).
_BACKBONE_HEAD_SOFTCAP = frozenset({"gemma2", "gemma4_text"})


@dataclass(frozen=True)
class ModelSplit:
    backbone: Callable[..., mx.array]  # (tokens [B,T], cache=list) -> hidden states [B,T,H]
    head: Callable[[mx.array], mx.array]  # hidden states [..., H] -> logits [..., vocab]
    softcap: float | None = None  # the family's final logit soft-capping, if any

    def logits(self, hidden: mx.array, head: Callable[[mx.array], mx.array] | None = None
               ) -> mx.array:
        """The model's logits for these hidden states, through `head` (e.g. the CPU fast head)
        in place of the model's own where given."""
        out = (head if head is not None else self.head)(hidden)
        if self.softcap:
            out = mx.tanh(out / self.softcap) * self.softcap
        return out


def _text_model(model: Any) -> Any:
    """The module that owns `model` (backbone) and the head: vision-language wrappers such as
    qwen3_5's keep it under `language_model`."""
    inner = getattr(model, "language_model", None)
    return inner if inner is not None and hasattr(inner, "model") else model


def _is_tied(text_model: Any) -> bool:
    # gemma3_text decides at load time (sanitize) and stores it on the instance; the others keep
    # it in their args.
    if "lm_head" in text_model:
        return False
    if hasattr(text_model, "tie_word_embeddings"):
        return bool(text_model.tie_word_embeddings)
    return bool(getattr(getattr(text_model, "args", None), "tie_word_embeddings", True))


_SPLITS: ObjectTable[ModelSplit | bool] = ObjectTable()  # model -> its split (False: none)


def split_model(model: Any) -> ModelSplit | None:
    """(backbone, head) of a known family, or None when the model's call does more than that."""
    cached = _SPLITS.get(model)
    if cached is not None:
        return cached or None
    text_model = _text_model(model)
    model_type = getattr(getattr(text_model, "args", None), "model_type", None)
    split: ModelSplit | None = None
    known = model_type in _BACKBONE_THEN_HEAD or model_type in _BACKBONE_HEAD_SOFTCAP
    if known and hasattr(text_model, "model"):
        backbone = text_model.model
        head = backbone.embed_tokens.as_linear if _is_tied(text_model) else text_model.lm_head
        softcap = (getattr(text_model, "final_logit_softcapping", None)
                   if model_type in _BACKBONE_HEAD_SOFTCAP else None)
        split = ModelSplit(backbone=backbone, head=head,
                           softcap=float(softcap) if softcap else None)
    _SPLITS.set(model, split or False)  # False marks "no split known"
    return split


def pipeline_stages(model: Any) -> int:
    """How many processes run this model's layers one stage after another (mlx-lm's
    `pipeline()`, rewind.parallel.shard); 1 when it runs whole here."""
    backbone = getattr(_text_model(model), "model", None)
    return int(getattr(backbone, "pipeline_size", 1) or 1)


def forget_split(model: Any) -> None:
    """Call after replacing a model's head (e.g. the loader's fast head) so it is looked up again."""
    _SPLITS.pop(model)


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
