"""The language model of Idefics 3 and SmolVLM folders, as mlx-lm's llama.

mlx-lm has no class for these folders (`model_type` idefics3 or smolvlm): their language model is
a plain llama whose sizes sit in `text_config`, but the weights are named for the vision model's
wrapper: `language_model.layers.*`, `language_model.lm_head` in mlx-vlm conversions (no `model.`
level), `model.text_model.*` and `lm_head` in Hugging Face checkpoints, next to the tower's and
connector's weights. `get_model_classes` hands mlx-lm's loader (`mlx_lm.utils.load_model(...,
get_model_classes=...)`) mlx-lm's llama with arguments read from `text_config` and a sanitize
that maps those names onto llama's and drops the vision weights, so the language model is
mlx-lm's own class (the engine's caches, prefill split and CPU kernels all apply).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import llama

# Weight-name prefixes of the language model in each layout -> mlx-lm's llama names; the
# longest match wins.
_TEXT_PREFIXES = {
    "language_model.lm_head.": "lm_head.",
    "language_model.": "model.",
    "model.text_model.": "model.",
    "lm_head.": "lm_head.",
}


def text_args(config: dict[str, Any]) -> llama.ModelArgs:
    """llama arguments from the folder's text_config. An output head of its own unless the
    folder says it is tied (mlx-vlm's Idefics 3 model always has one)."""
    text = dict(config.get("text_config") or {})
    text["model_type"] = "llama"  # what the engine's per-family code keys on
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    text.setdefault("vocab_size", config.get("vocab_size"))
    return llama.ModelArgs.from_dict(text)


class Model(llama.Model):
    # Subclasses for other wrappers' names replace it (rewind.models.llava_next_text).
    text_prefixes = _TEXT_PREFIXES

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        mapped = {}
        for name, value in weights.items():
            prefix = max((p for p in self.text_prefixes if name.startswith(p)), key=len,
                         default=None)
            if prefix is not None:  # the tower and connector are the vision side's
                mapped[self.text_prefixes[prefix] + name[len(prefix):]] = value
        return super().sanitize(mapped)


class ModelArgs:
    """What mlx-lm's loader calls `from_dict` on: the folder's config -> llama arguments."""

    @staticmethod
    def from_dict(config: dict[str, Any]) -> llama.ModelArgs:
        return text_args(config)


def get_model_classes(config: dict[str, Any]) -> tuple[type, type]:
    return Model, ModelArgs
