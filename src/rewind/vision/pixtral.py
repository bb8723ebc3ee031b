"""Pixtral and Mistral 3 vision: mlx-vlm's Pixtral tower (any image size, 2-D rotary positions
inside the tower) before a mistral/llama language model.

Prompt: the image placeholder is the image token itself (`[IMG]`). The image is scaled down to
fit the processor's longest edge and its sides rounded up to whole tokens (mlx-vlm's
`PixtralImageProcessor`, PIL/NumPy, used here as is), and the placeholder becomes one row of
image tokens per token row, `[IMG_BREAK]` between rows and `[IMG_END]` after the last, as the
Pixtral and Mistral 3 processors write it: a span of rows x (columns + 1) tokens. The break
tokens sit inside the image's span (`ImageLayout.tokens`) and keep their token embeddings.

- Pixtral (`pixtral`): one token per 16 px patch; the tower's last hidden states go through a
  two-layer projector (linear, GELU, linear).
- Mistral 3 (`mistral3`, Mistral Small 3.1 / 3.2): one token per 2x2 patches (28 px for 14 px
  patches); the projector norms the hidden states, merges each 2x2 block of patches (learned
  merge), then linear, GELU, linear.

Positions are the plain 1-D ones, so the language model is mlx-lm's (`pixtral` and `mistral3`
folders load as a llama inside, or mlx-lm's ministral3 for Ministral 3 text) with its normal
caches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.images import DecodedImage
from rewind.vision.family import (
    ImageLayout,
    VisionFamily,
    VisionUnavailableError,
    image_size,
    vlm_model_config,
)

IMAGE_BREAK, IMAGE_END = "[IMG_BREAK]", "[IMG_END]"


def row_layout(rows: int, columns: int, image: int, row_break: int, end: int) -> ImageLayout:
    """`rows` rows of `columns` image tokens, `row_break` between rows, `end` after the span."""
    tokens: list[int] = []
    for row in range(rows):
        if row:
            tokens.append(row_break)
        tokens.extend([image] * columns)
    return ImageLayout([], rows * columns, [end], tokens=tokens)


class PixtralVision(VisionFamily):
    name = "Pixtral"
    model_types = ("pixtral",)

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor

        super().__init__(path, config, dtype, tokenizer)
        self.model_config = vlm_model_config(config)
        self.feature_layer = self.model_config.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise VisionUnavailableError(f"{self.name} with several vision_feature_layer "
                                         "values is not supported")
        self.patch_size = int(self.model_config.vision_config.patch_size)
        self.merge_size = self._merge_size()
        self.image_token_id = int(self.model_config.image_token_index)
        self.placeholder_id = self.image_token_id
        names = self._processor_config()
        self.break_token_id = self._token_id(names.get("image_break_token", IMAGE_BREAK))
        self.end_token_id = self._token_id(names.get("image_end_token", IMAGE_END))
        self.processor = PixtralImageProcessor.from_pretrained(str(self.path))
        self.tower, self.projector = self._load()

    def _merge_size(self) -> int:
        return 1

    def _processor_config(self) -> dict[str, Any]:
        # The processor's token names, where the folder renames them (mlx-vlm reads them here).
        path = self.path / "processor_config.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _token_id(self, token: str) -> int:
        found = None if self.tokenizer is None else self.tokenizer.convert_tokens_to_ids(token)
        unknown = None if self.tokenizer is None else getattr(self.tokenizer, "unk_token_id", None)
        if not isinstance(found, int) or found == unknown:
            raise VisionUnavailableError(f"the tokenizer has no {token} token")
        return found

    def _projector(self) -> Any:
        from mlx_vlm.models.pixtral.pixtral import LlavaMultiModalProjector

        return LlavaMultiModalProjector(self.model_config)

    def _load(self) -> tuple[Any, Any]:
        import mlx.core as mx
        from mlx_vlm.models.pixtral.vision import VisionModel

        weights = self.load_weights(["vision_tower.", "multi_modal_projector."])
        tower = VisionModel(self.model_config.vision_config)
        tower.load_weights(list(tower.sanitize(weights["vision_tower."]).items()), strict=True)
        projector = self._projector()
        projector.load_weights(list(weights["multi_modal_projector."].items()), strict=True)
        self.finish_modules(tower, projector)
        # The tower's rotary table is a plain array, not a parameter: built lazily on this
        # thread, it would fail on the engine thread ("no Stream in current thread") unless
        # evaluated here.
        mx.eval(tower.vision_model.patch_positional_embedding.inv_freq)
        return tower, projector

    # ---- caller's thread --------------------------------------------------------------------

    @property
    def token_pixels(self) -> int:
        """Pixels per image token along each side."""
        return self.patch_size * self.merge_size

    def resized(self, image: DecodedImage) -> tuple[int, int]:
        """(height, width) the processor resizes this image to: whole tokens on each side."""
        from mlx_vlm.models.pixtral.image_processing_pixtral import (
            _size_to_pair,
            get_resize_output_image_size,
        )

        width, height = image_size(image)
        return get_resize_output_image_size((height, width), _size_to_pair(self.processor.size),
                                            self.token_pixels)

    def layout(self, image: DecodedImage) -> ImageLayout:
        height, width = self.resized(image)
        return row_layout(height // self.token_pixels, width // self.token_pixels,
                          self.image_token_id, self.break_token_id, self.end_token_id)

    def preprocess(self, image: DecodedImage) -> tuple[np.ndarray, tuple[int, int]]:
        """(pixels [H, W, 3] float32, (H, W)): resized to whole tokens, rescaled, normalized."""
        out = self.processor([image.rgb()], patch_size=self.token_pixels)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)[0].transpose(1, 2, 0)
        height, width = out["image_sizes"][0]
        return pixels, (int(height), int(width))

    # ---- engine thread ----------------------------------------------------------------------

    def hidden_states(self, pixels: tuple[np.ndarray, tuple[int, int]]) -> Any:
        """The tower's hidden states of `vision_feature_layer`: [1, patches, width]."""
        import mlx.core as mx

        array, size = pixels
        _, states = self.tower(mx.array(array[None]).astype(self.dtype),
                               output_hidden_states=True, image_sizes=[size])
        return states[self.feature_layer]

    def encode(self, pixels: tuple[np.ndarray, tuple[int, int]]) -> Any:
        return self.projector(self.hidden_states(pixels))[0]


class Mistral3Vision(PixtralVision):
    name = "Mistral 3"
    model_types = ("mistral3",)

    def _merge_size(self) -> int:
        return int(self.model_config.spatial_merge_size)

    def _projector(self) -> Any:
        from mlx_vlm.models.mistral3.mistral3 import Mistral3MultiModalProjector

        return Mistral3MultiModalProjector(self.model_config)

    def encode(self, pixels: tuple[np.ndarray, tuple[int, int]]) -> Any:
        # The patch merger reads each image's size to regroup its patches 2x2.
        return self.projector(self.hidden_states(pixels)[0], [pixels[1]])


__all__ = ["Mistral3Vision", "PixtralVision", "row_layout"]
