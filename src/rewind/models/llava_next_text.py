"""The language model of LLaVA-NeXT folders, as mlx-lm's llama.

mlx-lm has no class for `llava_next` folders: their language model is a llama or a mistral
(llava-v1.6-mistral-7b; mlx-lm loads `mistral` as its llama too) whose sizes sit in
`text_config` (filled from transformers' defaults where the folder leaves them out:
rewind.models.folder_quirks), under the wrapper's weight names: `language_model.model.*` and
`language_model.lm_head.*` in llava-hf's and mlx-vlm's folders, `model.language_model.*` and
`lm_head.*` as transformers 5 saves them, next to the tower, the projector and
`image_newline` (rewind.vision.llava_next's). `get_model_classes` hands mlx-lm's loader the same
llama as Idefics 3's (rewind.models.idefics3_text) with these names mapped, so text requests run
mlx-lm's own class (the engine's caches, prefill split and CPU kernels all apply).
"""

from __future__ import annotations

from typing import Any

from rewind.models import idefics3_text

# What the language model may be: what mlx-vlm's LLaVA-NeXT language model takes, and mlx-lm
# computes both as its llama. Others (qwen2 in LLaVA-OneVision-like folders) are refused.
TEXT_MODEL_TYPES = ("llama", "mistral")


class Model(idefics3_text.Model):
    text_prefixes = {
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
        "model.language_model.": "model.",
        "lm_head.": "lm_head.",
    }


def text_model_type(config: dict[str, Any]) -> str:
    # LlavaNextConfig builds a llama when text_config names no model type.
    return str((config.get("text_config") or {}).get("model_type", "llama"))


def get_model_classes(config: dict[str, Any]) -> tuple[type, type]:
    text_type = text_model_type(config)
    if text_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"LLaVA-NeXT with a {text_type!r} language model is not supported "
                         f"(supported: {', '.join(TEXT_MODEL_TYPES)})")
    return Model, idefics3_text.ModelArgs
