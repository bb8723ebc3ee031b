"""What some model folders need beyond what mlx-lm's loader does with them on its own.

transformers fills absent config fields from each config class's defaults; mlx-lm reads
config.json as it is and requires the sizes. `model_config_overrides(config)` returns the fields
to hand mlx-lm's loader (its `model_config`, which replaces top-level keys) so such folders load
as transformers would build them; an empty dict for every other folder. `model_classes(config)`
returns the `get_model_classes` for folders mlx-lm has no class for, None for the others.

Known quirks:

- LLaVA 1.5 from llava-hf (`model_type` "llava"): `text_config` names the llama's model type,
  context length and vocabulary but leaves its sizes to transformers' `LlamaConfig` defaults
  (the 7B sizes). Only the absent fields are filled, so a folder that states them is unchanged.
- Idefics 3 and SmolVLM (`idefics3`, `smolvlm`): no mlx-lm class; their language model is a
  llama under other weight names (rewind.models.idefics3_text).
- LLaVA-NeXT (`llava_next`): no mlx-lm class either (rewind.models.llava_next_text), and
  llava-hf's folders leave sizes to transformers' defaults as LLaVA 1.5's do: llava-v1.6-vicuna's
  llama all of them, llava-v1.6-mistral-7b's mistral its width, depth and heads (MistralConfig's
  defaults, the 7B's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# transformers' LlamaConfig defaults for the fields mlx-lm's llama needs (the LLaVA 1.5 7B
# language model). max_position_embeddings is 4096 as in llava-hf's configs and mlx-vlm's LLaVA
# text defaults (LlamaConfig's own is 2048); a llama without rope scaling does not read it.
LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}
LLAMA_VOCAB_SIZE = 32000  # LlamaConfig's, when the folder gives none at either level
# transformers' MistralConfig defaults for the same fields (the Mistral 7B's); its rope_theta
# is 10000 when the config gives none (llava-v1.6-mistral-7b states 1e6).
MISTRAL_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096 * 32,
}
MISTRAL_VOCAB_SIZE = 32000


def _text_defaults(config: dict[str, Any],
                   known: dict[str, tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """`text_config` with the absent fields of its model type's defaults (`known`: model type
    -> (defaults, vocabulary)) filled in; {} when none is absent or the type is not known."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        return {}
    text = dict(text or {})
    # LlavaConfig and LlavaNextConfig build a llama when text_config names no model type.
    text_type = text.get("model_type", "llama")
    if text_type not in known:
        return {}
    type_defaults, vocab_size = known[text_type]
    defaults = {"model_type": text_type, **type_defaults,
                "vocab_size": config.get("vocab_size", vocab_size)}
    # transformers 5 saves the rope's base inside rope_parameters, which mlx-lm does not read.
    rope = text.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        defaults["rope_theta"] = rope["rope_theta"]
    missing = {key: value for key, value in defaults.items() if key not in text}
    if not missing:
        return {}
    return {"text_config": {**text, **missing}}


def _llava_text_defaults(config: dict[str, Any]) -> dict[str, Any]:
    return _text_defaults(config, {"llama": (LLAMA_DEFAULTS, LLAMA_VOCAB_SIZE)})


def _llava_next_text_defaults(config: dict[str, Any]) -> dict[str, Any]:
    return _text_defaults(config, {"llama": (LLAMA_DEFAULTS, LLAMA_VOCAB_SIZE),
                                   "mistral": (MISTRAL_DEFAULTS, MISTRAL_VOCAB_SIZE)})


_QUIRKS = {"llava": _llava_text_defaults, "llava_next": _llava_next_text_defaults}


def model_config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Top-level config.json keys to replace for mlx-lm's loader; {} when the folder needs
    none."""
    quirk = _QUIRKS.get(config.get("model_type"))
    return quirk(config) if quirk is not None else {}


ModelClasses = Callable[[dict[str, Any]], tuple[type, type]]


def model_classes(config: dict[str, Any]) -> ModelClasses | None:
    """mlx-lm's `get_model_classes` for folders it has no class for; None: mlx-lm's own."""
    if config.get("model_type") in ("idefics3", "smolvlm"):
        from rewind.models.idefics3_text import get_model_classes

        return get_model_classes
    if config.get("model_type") == "llava_next":
        from rewind.models.llava_next_text import get_model_classes as llava_next_classes

        return llava_next_classes
    return None
