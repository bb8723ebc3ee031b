"""Tiny random-weight LLaVA, Pixtral and Mistral 3 model folders, for vision tests.

`build_tiny_vlm_model(out_dir, variant)` writes the layout of an mlx-vlm conversion:
config.json (`text_config` and `vision_config` nested, the image token index), one safetensors
file holding `language_model.*`, `vision_tower.*` and `multi_modal_projector.*`, a tokenizer with
the family's image tokens, and the image processor's preprocessor_config.json. Both loaders read
it: mlx-lm's class for the folder (`llava` loads as `mistral3`; both hold a llama) keeps the
language model, mlx-vlm's classes build the tower and projector (rewind.vision.llava,
rewind.vision.pixtral).

Sizes: the language model is tiny_models' llama (4 layers, 64 wide, 4 heads), with head_dim 16
(hidden / heads, which mlx-vlm's LLaVA assumes). Towers are 2 layers 32 wide:

- llava: CLIP, 112 px in 14 px patches (64 patches + the class token; "default" feature
  selection drops it): LLAVA_IMAGE_TOKENS = 64 per image, whatever its size.
- pixtral: Pixtral tower in 16 px patches, images scaled to fit 160 px: a 320x240 image is
  8 rows of 10 tokens (and 7 [IMG_BREAK], then [IMG_END]).
- mistral3: Pixtral tower in 14 px patches merged 2x2 (28 px a token), images fit in 224 px: a
  320x240 image is 6 rows of 8 tokens.
- ministral3: the mistral3 folder with Ministral 3's text model (mlx-lm's `ministral3`: yarn
  rope and Llama 4 attention scaling by position, past 64 positions here).

Built in about a second; everything is seeded. `save_random_vlm` is the shared part (mlx-vlm's
whole model with seeded weights, saved as one file), also used by rewind.testing.tiny_qwen_vl.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from rewind.testing.tiny_models import (
    BOS,
    EOS,
    PAD,
    SEED,
    SPECIAL_TOKENS,
    TURN_END,
    VOCAB_SIZE,
    WEIGHT_GAIN,
    _family_config,
    train_tokenizer,
)

# Each variant's folder model_type; "ministral3" is a Mistral 3 folder with Ministral 3's text.
VARIANTS = {"llava": "llava", "pixtral": "pixtral", "mistral3": "mistral3",
            "ministral3": "mistral3"}
LLAVA_IMAGE = "<image>"
IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
LLAVA_IMAGE_TOKENS = 64
# Text fields a llava-hf LLaVA 1.5 config may leave to transformers' defaults, where the default
# is also the tiny model's value (so mlx-vlm's defaults agree); rms_norm_eps is one mlx-lm
# requires. The 7B's config leaves its sizes out too, but their defaults are the 7B's.
TEXT_DEFAULTED = ("rms_norm_eps", "rope_theta", "max_position_embeddings")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def save_random_vlm(config: dict[str, Any], out_dir: Path, seed: int = SEED,
                    gain: float = WEIGHT_GAIN) -> None:
    """mlx-vlm's model for `config` with seeded random float32 weights, saved into `out_dir` as
    model.safetensors with config.json. The language model's matrices are scaled by `gain`
    (as tiny_models does, so greedy sequences vary)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from rewind.vision.family import vlm_model_config

    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    model = module.Model(vlm_model_config(config))
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("language_model.") and value.ndim >= 2:
            value = value * gain
        weights[name] = value.astype(mx.float32)
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _text_config(variant: str) -> dict[str, Any]:
    text = _family_config("llama")
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    if variant in ("pixtral", "mistral3"):
        text["model_type"] = "mistral"  # as Pixtral and Mistral Small 3.1 name their text model
        text["architectures"] = ["MistralForCausalLM"]
    elif variant == "ministral3":
        # Ministral 3's form (yarn, attention scaled by position), with small lengths so the
        # scaling changes within a test's prompts.
        text["model_type"] = "ministral3"
        text["architectures"] = ["Ministral3ForCausalLM"]
        text["rope_parameters"] = {
            "rope_type": "yarn", "type": "yarn", "rope_theta": text.pop("rope_theta"),
            "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 64}
    return text


def _vision_config(model_type: str) -> dict[str, Any]:
    common = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_hidden_layers": 2, "num_channels": 3}
    if model_type == "llava":
        return {**common, "model_type": "clip_vision_model", "image_size": 112,
                "patch_size": 14, "projection_dim": 32, "layer_norm_eps": 1e-5}
    patch_size, longest = (16, 160) if model_type == "pixtral" else (14, 224)
    return {**common, "model_type": "pixtral", "head_dim": 16, "image_size": longest,
            "patch_size": patch_size, "rope_theta": 10000.0}


def tiny_vlm_config(special_ids: dict[str, int], variant: str = "llava") -> dict[str, Any]:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}")
    model_type = VARIANTS[variant]
    text = _text_config(variant)
    ids = {"bos_token_id": special_ids[BOS], "pad_token_id": special_ids[PAD],
           "eos_token_id": [special_ids[TURN_END], special_ids[EOS]]}
    text["eos_token_id"] = ids["eos_token_id"]
    config = {"model_type": model_type, "text_config": text,
              "vision_config": _vision_config(model_type), "vocab_size": VOCAB_SIZE,
              "vision_feature_layer": -1, "projector_hidden_act": "gelu", **ids}
    if model_type == "llava":
        # LLaVA 1.5: the second to last layer, without the class token.
        return {**config, "architectures": ["LlavaForConditionalGeneration"],
                "image_token_index": special_ids[LLAVA_IMAGE], "vision_feature_layer": -2,
                "vision_feature_select_strategy": "default"}
    if model_type == "pixtral":
        return {**config, "architectures": ["LlavaForConditionalGeneration"],
                "image_token_index": special_ids[IMG]}
    return {**config, "architectures": ["Mistral3ForConditionalGeneration"],
            "image_token_index": special_ids[IMG], "spatial_merge_size": 2,
            "multimodal_projector_bias": False}


def _processor_files(model_type: str, vision: dict[str, Any]) -> dict[str, dict[str, Any]]:
    common = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
              "do_convert_rgb": True, "resample": 3}
    if model_type == "llava":
        # CLIP's processor: short side to the tower's size, centre crop to its square.
        side = vision["image_size"]
        return {
            "preprocessor_config.json": {
                **common, "image_processor_type": "CLIPImageProcessor",
                "size": {"shortest_edge": side}, "do_center_crop": True,
                "crop_size": {"height": side, "width": side}},
            # What mlx-vlm's LLaVA processor reads to count an image's tokens.
            "processor_config.json": {
                "processor_class": "LlavaProcessor", "patch_size": vision["patch_size"],
                "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                "image_token": LLAVA_IMAGE}}
    patch = vision["patch_size"]
    return {
        "preprocessor_config.json": {
            **common, "image_processor_type": "PixtralImageProcessor",
            "size": {"longest_edge": vision["image_size"]},
            "patch_size": {"height": patch, "width": patch}},
        "processor_config.json": {
            "processor_class": "PixtralProcessor" if model_type == "pixtral"
            else "Mistral3Processor", "patch_size": patch,
            "spatial_merge_size": 1 if model_type == "pixtral" else 2,
            "image_token": IMG, "image_break_token": IMG_BREAK, "image_end_token": IMG_END}}


def build_tiny_vlm_model(out_dir: Path, variant: str = "llava", seed: int = SEED,
                         gain: float = WEIGHT_GAIN, text_defaults: bool = False) -> Path:
    """Write the tiny `variant` (VARIANTS) model into `out_dir` and return `out_dir`.

    `text_defaults` (llava only): leave TEXT_DEFAULTED out of `text_config`, as llava-hf's
    LLaVA 1.5 configs leave the text model's fields to transformers' defaults (the tiny values
    equal those defaults, so the model is the same)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    image_tokens = [LLAVA_IMAGE] if variant == "llava" else [IMG, IMG_BREAK, IMG_END]
    special_ids = train_tokenizer(out_dir, [*SPECIAL_TOKENS, *image_tokens])
    config = tiny_vlm_config(special_ids, variant)
    if text_defaults:
        if variant != "llava":
            raise ValueError("text_defaults is LLaVA 1.5's quirk: variant must be llava")
        for name in TEXT_DEFAULTED:
            del config["text_config"][name]
    save_random_vlm(config, out_dir, seed, gain)
    for name, content in _processor_files(config["model_type"], config["vision_config"]).items():
        (out_dir / name).write_text(json.dumps(content, indent=2))
    return out_dir
