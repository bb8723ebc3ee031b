"""Gemma 3 vision: mlx-vlm's SigLIP tower and Gemma 3 projector.

An image placeholder (the begin-of-image token) becomes "\\n\\n", BOI, `mm_tokens_per_image`
(256) image tokens, EOI, "\\n\\n", as Gemma 3's processor writes it. The tower takes one square
image (resized, rescaled, normalized as preprocessor_config.json says); the projector pools it
into the image tokens. The language model multiplies every input embedding by sqrt(hidden), so
features go in divided by it (what mlx-vlm's Gemma 3 does). Positions are the plain 1-D ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.images import DecodedImage
from rewind.vision.family import ImageLayout, VisionFamily, vlm_model_config


def gemma3_vlm_config(config: dict[str, Any]) -> Any:
    """mlx-vlm's Gemma 3 ModelConfig with its nested text and vision configs built, as
    mlx_vlm.utils.load_model does."""
    from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig

    model_config = ModelConfig.from_dict(config)
    model_config.text_config = TextConfig.from_dict(config["text_config"])
    model_config.vision_config = VisionConfig.from_dict(config["vision_config"])
    return model_config


@dataclass(frozen=True)
class Preprocessing:
    size: tuple[int, int]  # (height, width)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float
    resample: int  # PIL resampling filter id

    @classmethod
    def from_folder(cls, path: Path, image_size: int) -> "Preprocessing":
        """preprocessor_config.json when present, else SigLIP's defaults for Gemma 3."""
        values: dict[str, Any] = {}
        config_file = path / "preprocessor_config.json"
        if config_file.exists():
            values = json.loads(config_file.read_text())
        size = values.get("size") or {}
        return cls(
            size=(int(size.get("height", image_size)), int(size.get("width", image_size))),
            mean=tuple(values.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(values.get("image_std", (0.5, 0.5, 0.5))),
            rescale=float(values.get("rescale_factor", 1 / 255)),
            resample=int(values.get("resample", 2)),  # 2 = bilinear
        )


class Gemma3Vision(VisionFamily):
    name = "Gemma 3"
    model_types = ("gemma3",)

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        super().__init__(path, config, dtype, tokenizer)
        self.model_config = gemma3_vlm_config(config)
        text = config["text_config"]
        self.hidden_size = int(text["hidden_size"])
        self.tokens_per_image = int(text.get("mm_tokens_per_image",
                                             config.get("mm_tokens_per_image", 256)))
        self.image_token_id = int(config["image_token_index"])
        self.boi_token_id = int(config["boi_token_index"])
        self.eoi_token_id = int(config["eoi_token_index"])
        self.placeholder_id = self.boi_token_id
        self.preprocessing = Preprocessing.from_folder(self.path,
                                                       self.model_config.vision_config.image_size)
        # Gemma 3's processor puts "\n\n" on each side of an image.
        self.newline_ids: list[int] = ([] if tokenizer is None else
                                       list(tokenizer.encode("\n\n", add_special_tokens=False)))
        self.tower, self.projector = self._load()

    def _load(self) -> tuple[Any, Any]:
        from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
        from mlx_vlm.models.gemma3.vision import VisionModel

        tower = VisionModel(self.model_config.vision_config)
        projector = Gemma3MultiModalProjector(self.model_config)
        weights = self.load_weights(["vision_tower.", "multi_modal_projector."])
        tower.load_weights(list(tower.sanitize(weights["vision_tower."]).items()), strict=True)
        projector.load_weights(list(weights["multi_modal_projector."].items()), strict=True)
        self.finish_modules(tower, projector)
        return tower, projector

    def layout(self, image: DecodedImage) -> ImageLayout:
        return ImageLayout([*self.newline_ids, self.boi_token_id], self.tokens_per_image,
                           [self.eoi_token_id, *self.newline_ids])

    def preprocess(self, image: DecodedImage) -> np.ndarray:
        """RGB pixels -> the tower's input [H, W, 3] float32 (resized, rescaled, normalized)."""
        height, width = self.preprocessing.size
        resized = image.rgb().resize((width, height), resample=self.preprocessing.resample)
        pixels = np.asarray(resized, dtype=np.float32) * self.preprocessing.rescale
        mean = np.asarray(self.preprocessing.mean, dtype=np.float32)
        std = np.asarray(self.preprocessing.std, dtype=np.float32)
        return (pixels - mean) / std

    def encode(self, pixels: np.ndarray) -> Any:
        import mlx.core as mx

        hidden, _, _ = self.tower(mx.array(pixels[None]).astype(self.dtype),
                                  output_hidden_states=True)
        return self.projector(hidden)[0]

    def to_embeddings(self, features: Any) -> Any:
        return features / (self.hidden_size ** 0.5)


__all__ = ["Gemma3Vision", "Preprocessing", "gemma3_vlm_config", "vlm_model_config"]
