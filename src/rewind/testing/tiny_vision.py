"""A tiny random-weight Gemma 3 vision-language model folder, for fast vision tests.

`build_tiny_vision_model(out_dir)` writes the same layout as an mlx-vlm conversion of Gemma 3
(config.json with `text_config` and `vision_config`, one safetensors file holding
`language_model.*`, `vision_tower.*` and `multi_modal_projector.*`, a tokenizer with the image
special tokens, preprocessor_config.json), so both loaders read it: mlx-lm's `gemma3` class keeps
the language model (the engine's text path) and mlx-vlm's `gemma3` classes build the SigLIP tower
and projector (rewind.vision.vlm).

Sizes: the text model is the tiny `gemma3` family of rewind.testing.tiny_models (6 layers,
sliding window 64 + global layers, so image spans cross rotating-cache windows); the tower is
2 SigLIP layers 32 wide over 224 px images in 14 px patches (256 patches), pooled 2x2 into
IMAGE_TOKENS = 64 image tokens. Built in about a second; everything is seeded.
"""

from __future__ import annotations

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

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
VISION_SPECIAL_TOKENS = [*SPECIAL_TOKENS, BOI, EOI, IMAGE_TOKEN]
IMAGE_SIZE = 224
PATCH_SIZE = 14
IMAGE_TOKENS = 64


def tiny_vision_config(special_ids: dict[str, int]) -> dict[str, Any]:
    text_config = _family_config("gemma3")
    text_config["mm_tokens_per_image"] = IMAGE_TOKENS
    # Tied like the real Gemma 3 (mlx-vlm's Gemma 3 always ties its output head to the embeddings).
    text_config["tie_word_embeddings"] = True
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": text_config["hidden_size"],
        "text_config": text_config,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "patch_size": PATCH_SIZE,
            "image_size": IMAGE_SIZE,
            "num_channels": 3,
            "layer_norm_eps": 1e-6,
        },
        "mm_tokens_per_image": IMAGE_TOKENS,
        "boi_token_index": special_ids[BOI],
        "eoi_token_index": special_ids[EOI],
        "image_token_index": special_ids[IMAGE_TOKEN],
        "bos_token_id": special_ids[BOS],
        "eos_token_id": [special_ids[TURN_END], special_ids[EOS]],
        "pad_token_id": special_ids[PAD],
    }


def _train_tokenizer(out_dir: Path) -> dict[str, int]:
    """The tiny byte-level BPE of tiny_models, plus Gemma 3's three image tokens."""
    # What Gemma 3's processor reads to expand an image placeholder.
    image_config = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN}
    return train_tokenizer(out_dir, VISION_SPECIAL_TOKENS, image_config)


def _preprocessor_config(image_size: int = IMAGE_SIZE,
                         image_tokens: int = IMAGE_TOKENS) -> dict[str, Any]:
    # Gemma 3's SigLIP preprocessing: resize to the tower's square, scale to [0, 1], then
    # normalize with mean 0.5 and std 0.5 (to [-1, 1]).
    return {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_resize": True,
        "size": {"height": image_size, "width": image_size},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "image_seq_length": image_tokens,
    }


def build_vision_folder(config: dict[str, Any], out_dir: Path, seed: int = SEED,
                        gain: float = WEIGHT_GAIN, dtype: Any = None) -> None:
    """Write random weights for a Gemma 3 VLM `config` (language model, tower, projector) into
    `out_dir` as one safetensors file (`dtype`, default float32; the benchmark's large configs
    use bfloat16). `gain` scales the language model's matrices (see tiny_models)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3 as lm_gemma3
    from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
    from mlx_vlm.models.gemma3.vision import VisionModel

    from rewind.vision.gemma3 import gemma3_vlm_config

    mx.random.seed(seed)
    weights: dict[str, Any] = {}
    language = lm_gemma3.Model(lm_gemma3.ModelArgs.from_dict(
        {"model_type": "gemma3", "text_config": dict(config["text_config"]),
         "vocab_size": config["vocab_size"]}))
    weights.update({name: value for name, value in _scaled(tree_flatten(language.parameters()),
                                                           gain).items()
                    if not name.endswith("lm_head.weight")})  # tied: no separate head
    vlm_config = gemma3_vlm_config(config)
    tower = VisionModel(vlm_config.vision_config)
    projector = Gemma3MultiModalProjector(vlm_config)
    # mlx initializes the projection matrix to ones (every output dimension equal): random, so
    # that different images give different embeddings.
    projector.mm_input_projection_weight = mx.random.normal(
        projector.mm_input_projection_weight.shape) * (vlm_config.vision_config.hidden_size ** -0.5)
    weights.update({f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())})
    weights.update({f"multi_modal_projector.{k}": v
                    for k, v in tree_flatten(projector.parameters())})
    weights = {k: v.astype(dtype or mx.float32) for k, v in weights.items()}
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})


def _scaled(items: list[tuple[str, Any]], gain: float) -> dict[str, Any]:
    # As tiny_models does: matrices scaled so greedy sequences vary.
    if gain == 1.0:
        return dict(items)
    return {name: value * gain if value.ndim >= 2 else value for name, value in items}


def build_tiny_vision_model(out_dir: Path, seed: int = SEED,
                            config_override: dict[str, Any] | None = None,
                            gain: float = WEIGHT_GAIN, dtype: Any = None) -> Path:
    """Write the tiny Gemma 3 vision model into `out_dir` and return `out_dir`.

    `config_override` replaces top-level config keys (text_config, vision_config, vocab_size,
    ...): the benchmark builds real-size configs around this small tokenizer."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special_ids = _train_tokenizer(out_dir)
    config = tiny_vision_config(special_ids)
    for key, value in (config_override or {}).items():
        config[key] = value
    build_vision_folder(config, out_dir, seed, gain, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    image_size = int(config["vision_config"]["image_size"])
    image_tokens = int(config["text_config"]["mm_tokens_per_image"])
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(_preprocessor_config(image_size, image_tokens), indent=2))
    (out_dir / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": image_tokens}, indent=2))
    return out_dir
