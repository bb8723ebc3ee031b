"""A tiny random-weight LLaVA-NeXT model folder, for vision tests.

`build_tiny_llava_next_model(out_dir)` writes the layout of an mlx-vlm conversion (and of
llava-hf's folders, which use the same weight names): config.json (`text_config` and
`vision_config` nested, `image_grid_pinpoints`, the image token index), one safetensors file
holding `language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*` and `image_newline`, a tokenizer with `<image>`, and the processor's
preprocessor_config.json (LlavaNextImageProcessor) and processor_config.json
(LlavaNextProcessor), as llava-hf folders have them. mlx-vlm's classes read it all; Rewind's
loader reads the language model as mlx-lm's llama (rewind.models.llava_next_text) and
rewind.vision.llava_next the tower, projector and newline.

It is the tiny LLaVA 1.5 folder of rewind.testing.tiny_vlm (tiny_models' llama, a 2-layer CLIP
tower 32 wide in 14 px patches, "default" feature selection from the second to last layer)
with LLaVA-NeXT's anyres tiling: the tower takes TILE_PIXELS (56 px) tiles, 4x4 patches each,
and PINPOINTS are llava-hf's five grids (1x2, 2x1, 2x2, 3x1, 1x3 tiles) scaled from 336 px
tiles to 56 px. An image is its best-fit grid's tiles and the whole image at 56 px: a 320x240
image is a 2x2 grid (8x8 patches, unpadded to 6 rows of 8, a newline after each row) after
the 16 base features, 70 image tokens. `text_model_type="mistral"` names the language model
`mistral` (llava-v1.6-mistral-7b's form; the same llama weights). Built in about a second;
everything is seeded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rewind.testing.tiny_models import SEED, SPECIAL_TOKENS, WEIGHT_GAIN, train_tokenizer
from rewind.testing.tiny_vlm import (
    LLAVA_IMAGE,
    _processor_files,
    save_random_vlm,
    tiny_vlm_config,
)

TILE_PIXELS, PATCH_PIXELS = 56, 14
# llava-hf's LLaVA-NeXT grids ([height, width] in px of 336 px tiles), in 56 px tiles.
PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
TEXT_MODEL_TYPES = ("llama", "mistral")


def tiny_llava_next_config(special_ids: dict[str, int], text_model_type: str = "llama"
                           ) -> dict[str, Any]:
    if text_model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"text_model_type must be one of {TEXT_MODEL_TYPES}")
    config = tiny_vlm_config(special_ids, "llava")
    config.update(model_type="llava_next", architectures=["LlavaNextForConditionalGeneration"],
                  image_grid_pinpoints=PINPOINTS, use_image_newline_parameter=True)
    config["vision_config"]["image_size"] = TILE_PIXELS
    config["vision_config"]["patch_size"] = PATCH_PIXELS
    config["text_config"]["model_type"] = text_model_type
    return config


def _llava_next_processor_files(vision: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """LLaVA 1.5's files (CLIP's image processor settings: short side to the tile, centre crop)
    as LLaVA-NeXT's processors: the grids, padding, and the processor's class."""
    files = _processor_files("llava", vision)
    files["preprocessor_config.json"].update(
        image_processor_type="LlavaNextImageProcessor", processor_class="LlavaNextProcessor",
        image_grid_pinpoints=PINPOINTS, do_pad=True)
    files["processor_config.json"]["processor_class"] = "LlavaNextProcessor"
    return files


def build_tiny_llava_next_model(out_dir: Path, text_model_type: str = "llama", seed: int = SEED,
                                gain: float = WEIGHT_GAIN) -> Path:
    """Write the tiny LLaVA-NeXT model into `out_dir` and return `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special_ids = train_tokenizer(out_dir, [*SPECIAL_TOKENS, LLAVA_IMAGE])
    config = tiny_llava_next_config(special_ids, text_model_type)
    save_random_vlm(config, out_dir, seed, gain)
    for name, content in _llava_next_processor_files(config["vision_config"]).items():
        (out_dir / name).write_text(json.dumps(content, indent=2))
    return out_dir
