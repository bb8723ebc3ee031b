"""Which mlx-lm models split into a backbone (embeddings + layers + final norm) and an output
head, and the two halves of those that do.

mlx-lm model classes do not expose that split, so `split_model` knows the families whose
`Model.__call__` is exactly "backbone, then head" and returns None for others. The engine runs the
head on the last position only through it (rewind.engine.forward), and the CPU kernels replace
its halves (rewind.kernels.native_forward: the backbone; rewind.kernels.fast_head: the head); it
lives here, below both, so that neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from rewind.kernels.object_table import ObjectTable

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
