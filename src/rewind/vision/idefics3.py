"""Idefics 3 and SmolVLM vision: mlx-vlm's SigLIP-style tower and pixel-shuffle connector before
a llama language model (mlx-lm's llama, loaded by rewind.models.idefics3_text).

Pixels (the folder's image processor, transformers' PIL backend, which needs no torch): the
image is scaled so its longest edge is the processor's `size` (up or down), each side rounded
up to whole tiles of `max_image_size`, and cut into rows x columns of tiles; the whole image
scaled to one tile comes last (the "global" image). An image that fits one tile is that one
frame only. Each frame gives `image_seq_len` features: the tower's patches, merged
`scale_factor` x `scale_factor` by the connector's pixel shuffle and projected.

Prompt (as mlx-vlm's and transformers' processors write it): the image placeholder is the image
token itself (`<image>`); it becomes, for each tile, `<fake_token_around_image><row_r_col_c>`
and the tile's image tokens, a newline after each row of tiles, then a newline,
`<fake_token_around_image><global-img>`, the global image's tokens and
`<fake_token_around_image>`. All of it is the image's span (its cache keys carry the image
hash); the markers and newlines keep their token embeddings, the image tokens take the frames'
features in order (`ImageLayout.tokens`). Positions are 1-D.
"""

from __future__ import annotations

import math
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

FAKE_IMAGE, GLOBAL_IMAGE = "<fake_token_around_image>", "<global-img>"


class Idefics3Vision(VisionFamily):
    name = "Idefics 3 / SmolVLM"
    model_types = ("idefics3", "smolvlm")

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        super().__init__(path, config, dtype, tokenizer)
        if tokenizer is None:
            raise VisionUnavailableError("Idefics 3 / SmolVLM image prompts need the folder's "
                                         "tokenizer (their markers are tokens of it)")
        self.model_config = vlm_model_config(config)
        vision = self.model_config.vision_config
        self.tile_patches = int(vision.image_size) // int(vision.patch_size)
        scale = int(self.model_config.scale_factor)
        self.tokens_per_frame = self.tile_patches ** 2 // scale ** 2
        self.image_token_id = int(self.model_config.image_token_index)
        self.placeholder_id = self.image_token_id
        self.fake_image_id = self._token_id(FAKE_IMAGE)
        self.global_image_id = self._token_id(GLOBAL_IMAGE)
        # The text between a row of tiles and what follows: its newline, or (after the last
        # row) the global image's newline too, tokenized together as the processors' text is.
        self.row_end = list(tokenizer.encode("\n", add_special_tokens=False))
        self.tiles_end = list(tokenizer.encode("\n\n", add_special_tokens=False))
        self.processor = self._image_processor()
        self.tower, self.connector = self._load()

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == getattr(self.tokenizer, "unk_token_id", None):
            raise VisionUnavailableError(f"the tokenizer has no {token} token")
        return int(token_id)

    def _image_processor(self) -> Any:
        import json

        from transformers import AutoImageProcessor

        if not (self.path / "preprocessor_config.json").exists():
            raise VisionUnavailableError(f"{self.path} has no preprocessor_config.json (the "
                                         "image processor's settings)")
        processor_config = self.path / "processor_config.json"
        if processor_config.exists():
            stated = json.loads(processor_config.read_text()).get("image_seq_len")
            if stated is not None and int(stated) != self.tokens_per_frame:
                raise VisionUnavailableError(
                    f"processor_config.json says {stated} image tokens a tile; the tower and "
                    f"connector make {self.tokens_per_frame}")
        return AutoImageProcessor.from_pretrained(str(self.path), backend="pil")

    def _load(self) -> tuple[Any, Any]:
        from mlx_vlm.models.idefics3.idefics3 import Idefics3Connector
        from mlx_vlm.models.idefics3.vision import VisionModel

        weights = self.load_weights(["vision_model.", "connector."])
        tower = VisionModel(self.model_config.vision_config)
        tower.load_weights(list(tower.sanitize(weights["vision_model."]).items()), strict=True)
        connector = Idefics3Connector(self.model_config)
        connector.load_weights(list(weights["connector."].items()), strict=True)
        self.finish_modules(tower, connector)
        return tower, connector

    # ---- caller's thread --------------------------------------------------------------------

    def tiles(self, image: DecodedImage) -> tuple[int, int]:
        """(rows, columns) of tiles the processor cuts the image into; (0, 0): one frame."""
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            get_resize_output_image_size,
        )

        processor = self.processor
        if not processor.do_image_splitting:
            return 0, 0
        width, height = image_size(image)
        if processor.do_resize:
            height, width = get_resize_output_image_size(  # it reads the array's shape only
                np.empty((0, height, width)), processor.size["longest_edge"])
        # The processor's resize_for_vision_encoder: each side up to whole tiles, the second
        # one from the first's aspect ratio.
        tile = processor.max_image_size["longest_edge"]
        aspect = width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        if height <= tile and width <= tile:
            return 0, 0
        return (height - tile) // tile + 1, (width - tile) // tile + 1

    def layout(self, image: DecodedImage) -> ImageLayout:
        rows, columns = self.tiles(image)
        frame = [self.image_token_id] * self.tokens_per_frame
        tokens: list[int] = []
        for row in range(1, rows + 1):
            for column in range(1, columns + 1):
                tokens += [self.fake_image_id, self._token_id(f"<row_{row}_col_{column}>"),
                           *frame]
            tokens += self.row_end if row < rows else self.tiles_end
        tokens += [self.fake_image_id, self.global_image_id, *frame, self.fake_image_id]
        frames = rows * columns + 1
        return ImageLayout([], frames * self.tokens_per_frame, [], tokens=tokens)

    def preprocess(self, image: DecodedImage) -> np.ndarray:
        """RGB pixels -> the tower's input: frames [tiles + 1 (or 1), H, W, 3] float32."""
        out = self.processor([[image.rgb()]], return_row_col_info=True)
        frames = np.asarray(out["pixel_values"], dtype=np.float32)[0].transpose(0, 2, 3, 1)
        expected = self.tiles(image)
        got = (out["rows"][0][0], out["cols"][0][0])
        if got != expected:
            raise ValueError(f"the image processor cut {got} tiles where the layout has "
                             f"{expected}")
        return frames

    # ---- engine thread ----------------------------------------------------------------------

    def encode(self, pixels: np.ndarray) -> Any:
        import mlx.core as mx

        frames = mx.array(pixels).astype(self.dtype)
        # Every frame is a whole tile (no padding inside a frame): every patch attends.
        patches = mx.ones((frames.shape[0], self.tile_patches, self.tile_patches), mx.bool_)
        hidden, *_ = self.tower(frames, patch_attention_mask=patches, output_hidden_states=True)
        features = self.connector(hidden)
        return features.reshape(-1, features.shape[-1])


__all__ = ["Idefics3Vision"]
