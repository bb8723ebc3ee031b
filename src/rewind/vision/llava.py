"""LLaVA (1.5-style) vision: mlx-vlm's CLIP (or SigLIP) tower and two-layer projector before a
llama language model.

Prompt: the image placeholder is the image token itself (`<image>`); it becomes one image token
per patch of the tower's square input, fewer the class token when the folder selects features
the "default" way (576 for LLaVA 1.5's 336 px CLIP in 14 px patches). The count is fixed by the
tower, so it does not depend on the image.

Pixels: the folder's own image processor (preprocessor_config.json, usually CLIP's: resize the
short side, centre crop, rescale, normalize), in transformers' PIL backend, which needs no torch;
mlx-vlm's LLaVA processor loads the same one.

Features: the hidden states of `vision_feature_layer` (the second to last layer for LLaVA 1.5),
without the class token for "default", through the projector (linear, GELU, linear). They
replace the image tokens' input embeddings; positions are the plain 1-D ones, so the language
model is mlx-lm's (its `llava` folders load as `mistral3`, a llama inside) with its normal caches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.images import DecodedImage
from rewind.vision.family import (
    ImageLayout,
    VisionFamily,
    VisionUnavailableError,
    vlm_model_config,
)

# mlx-vlm's LLaVA language model is llama (or qwen2, which mlx-lm's llava class cannot load).
TEXT_MODEL_TYPES = ("llama",)


class LlavaVision(VisionFamily):
    name = "LLaVA"
    model_types = ("llava",)

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        super().__init__(path, config, dtype, tokenizer)
        text_type = (config.get("text_config") or {}).get("model_type")
        if text_type not in TEXT_MODEL_TYPES:
            raise VisionUnavailableError(
                f"LLaVA with a {text_type!r} language model is not supported (only "
                f"{', '.join(TEXT_MODEL_TYPES)}: what both mlx-lm and mlx-vlm load)")
        self.model_config = vlm_model_config(config)
        vision = self.model_config.vision_config
        if vision.model_type not in ("clip_vision_model", "siglip_vision_model"):
            raise VisionUnavailableError(
                f"LLaVA with a {vision.model_type!r} vision tower is not supported (mlx-vlm's "
                "LLaVA takes CLIP or SigLIP towers)")
        self.feature_layer = self.model_config.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise VisionUnavailableError("LLaVA with several vision_feature_layer values is not "
                                         "supported")
        self.drop_class_token = self.model_config.vision_feature_select_strategy == "default"
        self.image_size = int(vision.image_size)
        patches = (self.image_size // int(vision.patch_size)) ** 2
        outputs = patches + (1 if vision.model_type == "clip_vision_model" else 0)
        self.tokens_per_image = outputs - (1 if self.drop_class_token else 0)
        self.image_token_id = int(self.model_config.image_token_index)
        self.placeholder_id = self.image_token_id
        self.processor = self._image_processor()
        self.tower, self.projector = self._load()

    def _image_processor(self) -> Any:
        from transformers import AutoImageProcessor

        if not (self.path / "preprocessor_config.json").exists():
            raise VisionUnavailableError(f"{self.path} has no preprocessor_config.json (the "
                                         "LLaVA image processor's settings)")
        return AutoImageProcessor.from_pretrained(str(self.path), backend="pil")

    def _load(self) -> tuple[Any, Any]:
        from mlx_vlm.models.llava.llava import LlavaMultiModalProjector
        from mlx_vlm.models.llava.vision import VisionModel

        weights = self.load_weights(["vision_tower.", "multi_modal_projector."])
        tower = VisionModel(self.model_config.vision_config)
        tower.load_weights(list(tower.sanitize(weights["vision_tower."]).items()), strict=True)
        projector = LlavaMultiModalProjector(self.model_config)
        projector.load_weights(list(weights["multi_modal_projector."].items()), strict=True)
        self.finish_modules(tower, projector)
        return tower, projector

    # ---- caller's thread --------------------------------------------------------------------

    def layout(self, image: DecodedImage) -> ImageLayout:
        return ImageLayout([], self.tokens_per_image, [])

    def preprocess(self, image: DecodedImage) -> np.ndarray:
        """RGB pixels -> the tower's input [H, W, 3] float32, as the folder's processor makes it."""
        out = self.processor(image.rgb(), return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)[0].transpose(1, 2, 0)
        if pixels.shape[:2] != (self.image_size, self.image_size):
            raise VisionUnavailableError(
                f"the folder's image processor makes {pixels.shape[1]}x{pixels.shape[0]} px "
                f"images; the tower takes {self.image_size}x{self.image_size}")
        return pixels

    # ---- engine thread ----------------------------------------------------------------------

    def encode(self, pixels: np.ndarray) -> Any:
        import mlx.core as mx

        *_, hidden_states = self.tower(mx.array(pixels[None]).astype(self.dtype),
                                       output_hidden_states=True)
        selected = hidden_states[self.feature_layer]
        if self.drop_class_token:
            selected = selected[:, 1:]
        return self.projector(selected)[0]


__all__ = ["LlavaVision"]
