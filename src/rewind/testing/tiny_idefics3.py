"""Tiny random-weight Idefics 3 and SmolVLM model folders, for vision tests.

`build_tiny_idefics3_model(out_dir, model_type)` writes the layout of an mlx-vlm conversion:
config.json (`text_config` and `vision_config` nested, the image token id, the connector's
`scale_factor`), one safetensors file holding `language_model.*` (no `model.` level),
`vision_model.*` and `connector.*`, a tokenizer with the image tokens (`<image>`,
`<fake_token_around_image>`, `<global-img>`, `<row_i_col_j>` for up to MAX_TILES_PER_SIDE tiles
a side), and the processor's preprocessor_config.json and processor_config.json. mlx-vlm's own
classes read it all; Rewind's loader reads the language model as mlx-lm's llama
(rewind.models.idefics3_text) and rewind.vision.idefics3 the tower and connector.

Sizes: the language model is tiny_models' llama (4 layers, 64 wide, 4 heads of 16, as mlx-vlm's
Idefics 3 language model assumes hidden / heads); the tower is 2 layers 32 wide in 14 px
patches over 112 px tiles, pixel-shuffled 2x2: TOKENS_PER_TILE = 16 image tokens a tile. Images
are scaled to a longest edge of 224 px, then cut into 112 px tiles plus the whole image at
112 px: a 320x240 image is 2x2 tiles and the global image, 80 image tokens. Built in about a
second; everything is seeded.
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
from rewind.testing.tiny_vlm import save_random_vlm

MODEL_TYPES = ("idefics3", "smolvlm")
IMAGE, FAKE_IMAGE, GLOBAL_IMAGE = "<image>", "<fake_token_around_image>", "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
MAX_TILES_PER_SIDE = 4
TILE_PIXELS, PATCH_PIXELS, SCALE_FACTOR = 112, 14, 2
LONGEST_EDGE = 2 * TILE_PIXELS
TOKENS_PER_TILE = (TILE_PIXELS // PATCH_PIXELS) ** 2 // SCALE_FACTOR ** 2
IMAGE_TOKENS = [IMAGE, FAKE_IMAGE, GLOBAL_IMAGE, END_OF_UTTERANCE] + [
    f"<row_{row}_col_{col}>" for row in range(1, MAX_TILES_PER_SIDE + 1)
    for col in range(1, MAX_TILES_PER_SIDE + 1)]


def tiny_idefics3_config(special_ids: dict[str, int], model_type: str = "idefics3"
                         ) -> dict[str, Any]:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}")
    text = _family_config("llama")
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    ids = {"bos_token_id": special_ids[BOS], "pad_token_id": special_ids[PAD],
           "eos_token_id": [special_ids[TURN_END], special_ids[EOS]]}
    text["eos_token_id"] = ids["eos_token_id"]
    vision = {"model_type": f"{model_type}_vision", "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 2, "num_hidden_layers": 2, "num_channels": 3,
              "image_size": TILE_PIXELS, "patch_size": PATCH_PIXELS, "layer_norm_eps": 1e-6}
    architecture = ("Idefics3ForConditionalGeneration" if model_type == "idefics3"
                    else "SmolVLMForConditionalGeneration")
    return {"model_type": model_type, "architectures": [architecture], "text_config": text,
            "vision_config": vision, "vocab_size": VOCAB_SIZE, "scale_factor": SCALE_FACTOR,
            "image_token_id": special_ids[IMAGE], "tie_word_embeddings": False, **ids}


def _processor_files(model_type: str) -> dict[str, dict[str, Any]]:
    prefix = "Idefics3" if model_type == "idefics3" else "SmolVLM"
    return {
        "preprocessor_config.json": {
            "image_processor_type": f"{prefix}ImageProcessor",
            "processor_class": f"{prefix}Processor",
            "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": LONGEST_EDGE},
            "resample": 1, "do_image_splitting": True,
            "max_image_size": {"longest_edge": TILE_PIXELS}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "do_pad": True},
        "processor_config.json": {"processor_class": f"{prefix}Processor",
                                  "image_seq_len": TOKENS_PER_TILE},
    }


def build_tiny_idefics3_model(out_dir: Path, model_type: str = "idefics3", seed: int = SEED,
                              gain: float = WEIGHT_GAIN) -> Path:
    """Write the tiny `model_type` (MODEL_TYPES) model into `out_dir` and return `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special_ids = train_tokenizer(out_dir, [*SPECIAL_TOKENS, *IMAGE_TOKENS])
    config = tiny_idefics3_config(special_ids, model_type)
    save_random_vlm(config, out_dir, seed, gain)
    for name, content in _processor_files(model_type).items():
        (out_dir / name).write_text(json.dumps(content, indent=2))
    return out_dir
