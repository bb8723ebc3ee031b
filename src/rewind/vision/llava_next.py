"""LLaVA-NeXT (LLaVA 1.6) vision: mlx-vlm's CLIP tower and two-layer projector over "anyres"
tiles, before a llama or mistral language model (mlx-lm's llama, loaded by
rewind.models.llava_next_text).

Pixels (the folder's image processor, transformers' PIL backend, which needs no torch): the
processor picks the grid in `image_grid_pinpoints` that fits the image best (most of its pixels
kept, least padding), scales the image into it keeping the aspect ratio, pads it (centred) and
cuts it into tower-sized tiles; the whole image resized to one tile comes first. The tower runs
on all of them at once.

Features, as transformers' LlavaNextModel packs them (`pack_image_features`): the hidden states
of `vision_feature_layer` without the class token ("default" selection), through the projector;
the first frame's features (the whole image) come first, then the grid's tiles joined into one
feature map of rows x columns patches, with the rows or columns the padding added cut off again
("unpadded", from the image's own aspect ratio), and the learned `image_newline` embedding after
each row. mlx-vlm's own LLaVA-NeXT model skips the grid packing (it hands the language model
every frame's features and a frame of newlines, not what transformers' processor counts), so
Rewind follows transformers there and uses mlx-vlm's tower and projector as they are.

Prompt: the placeholder is the image token itself (`<image>`); it becomes as many image tokens
as transformers' LlavaNextProcessor writes for the image's size (`_get_number_of_features`),
computed here from the size alone: tile patches squared, plus the unpadded grid's rows x
(columns + 1). 1-D positions; the language model's caches are its normal ones.
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
    image_size,
    vlm_model_config,
)

# LlavaNextConfig's, for folders that leave them out ([height, width] px; 336 px tiles).
DEFAULT_GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# Weight-name prefixes of the tower, the projector and the newline: llava-hf's and mlx-vlm's
# folders, then transformers 5's.
WEIGHT_LAYOUTS = (("vision_tower.", "multi_modal_projector.", "image_newline"),
                  ("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline"))


def unpadded_size(height: int, width: int, rows: int, columns: int) -> tuple[int, int, int, int]:
    """The feature map of the grid (`rows` x `columns` patches) less what padded the image of
    `height` x `width` px: (rows, columns, first row, first column) kept. transformers'
    `unpad_image` (and LlavaNextProcessor's count, the same arithmetic): the padding is cut
    evenly from both sides of the longer dimension, so an odd leftover stays."""
    if width / height > columns / rows:  # padded above and below
        kept = int(round(height * (columns / width), 7))
        pad = (rows - kept) // 2
        return rows - 2 * pad, columns, pad, 0
    kept = int(round(width * (rows / height), 7))
    pad = (columns - kept) // 2
    return rows, columns - 2 * pad, 0, pad


class LlavaNextVision(VisionFamily):
    name = "LLaVA-NeXT"
    model_types = ("llava_next",)

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        from rewind.models.folder_quirks import model_config_overrides
        from rewind.models.llava_next_text import TEXT_MODEL_TYPES, text_model_type

        super().__init__(path, config, dtype, tokenizer)
        if text_model_type(config) not in TEXT_MODEL_TYPES:
            raise VisionUnavailableError(
                f"LLaVA-NeXT with a {text_model_type(config)!r} language model is not supported "
                f"(only {', '.join(TEXT_MODEL_TYPES)})")
        # The text sizes the folder leaves to transformers' defaults size the projector too.
        self.model_config = vlm_model_config({**config, **model_config_overrides(config)})
        vision = self.model_config.vision_config
        if vision.model_type != "clip_vision_model":
            raise VisionUnavailableError(
                f"LLaVA-NeXT with a {vision.model_type!r} vision tower is not supported "
                "(mlx-vlm's LLaVA-NeXT takes CLIP towers)")
        self.feature_layer = self.model_config.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise VisionUnavailableError("LLaVA-NeXT with several vision_feature_layer values "
                                         "is not supported")
        if self.model_config.vision_feature_select_strategy != "default":
            # With the class token kept, a tile's features are not its patch grid: transformers'
            # packing cannot lay the tiles out either.
            raise VisionUnavailableError(
                "LLaVA-NeXT with vision_feature_select_strategy "
                f"{self.model_config.vision_feature_select_strategy!r} is not supported (only "
                "'default', which drops the CLIP tower's class token)")
        self.tile_pixels = int(vision.image_size)
        self.tile_patches = self.tile_pixels // int(vision.patch_size)
        self.pinpoints = [list(p) for p in config.get("image_grid_pinpoints")
                          or DEFAULT_GRID_PINPOINTS]
        self.image_token_id = int(self.model_config.image_token_index)
        self.placeholder_id = self.image_token_id
        self.processor = self._image_processor()
        self.tower, self.projector, self.newline = self._load()

    def _image_processor(self) -> Any:
        from transformers import AutoImageProcessor

        if not (self.path / "preprocessor_config.json").exists():
            raise VisionUnavailableError(f"{self.path} has no preprocessor_config.json (the "
                                         "LLaVA-NeXT image processor's settings)")
        processor = AutoImageProcessor.from_pretrained(str(self.path), backend="pil")
        # The processor tiles by its grids, the model packs by config.json's: they must agree.
        grids = [list(p) for p in getattr(processor, "image_grid_pinpoints", None) or []]
        if grids != self.pinpoints:
            raise VisionUnavailableError(
                f"the image processor's image_grid_pinpoints {grids} differ from config.json's "
                f"{self.pinpoints}")
        return processor

    def _load(self) -> tuple[Any, Any, Any]:
        import mlx.core as mx
        from mlx_vlm.models.llava_next.llava_next import LlavaMultiModalProjector
        from mlx_vlm.models.llava_next.vision import VisionModel

        errors = []
        for tower_prefix, projector_prefix, newline_name in WEIGHT_LAYOUTS:
            try:
                weights = self.load_weights([tower_prefix, projector_prefix, newline_name])
                break
            except VisionUnavailableError as exc:  # no such weights (or a quantized tower)
                errors.append(exc)
        else:
            raise errors[0]
        tower = VisionModel(self.model_config.vision_config)
        tower.load_weights(list(tower.sanitize(weights[tower_prefix]).items()), strict=True)
        projector = LlavaMultiModalProjector(self.model_config)
        projector.load_weights(list(weights[projector_prefix].items()), strict=True)
        newline = weights[newline_name].get("")
        hidden = int(self.model_config.text_config.hidden_size)
        if newline is None or tuple(newline.shape) != (hidden,):
            raise VisionUnavailableError(f"{self.path} has no image_newline weight of "
                                         f"{hidden} values")
        self.finish_modules(tower, projector)
        newline = newline.astype(self.dtype)
        mx.eval(newline)
        return tower, projector, newline

    # ---- caller's thread --------------------------------------------------------------------

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of `height` x `width` px: the best-fitting
        pinpoint, as the processor picks it (transformers' select_best_resolution)."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution((height, width), self.pinpoints)
        return best_height // self.tile_pixels, best_width // self.tile_pixels

    def feature_map(self, height: int, width: int) -> tuple[int, int, int, int]:
        """The unpadded grid feature map of an image: (rows, columns, first row, first column)
        in patches."""
        rows, columns = self.grid(height, width)
        return unpadded_size(height, width, rows * self.tile_patches,
                             columns * self.tile_patches)

    def layout(self, image: DecodedImage) -> ImageLayout:
        width, height = image_size(image)
        rows, columns, _, _ = self.feature_map(height, width)
        return ImageLayout([], self.tile_patches ** 2 + rows * (columns + 1), [])

    def preprocess(self, image: DecodedImage) -> tuple[np.ndarray, tuple[int, int]]:
        """RGB pixels -> (frames [1 + tiles, H, W, 3] float32: the whole image, then the grid's
        tiles row by row; the image's (height, width), which the packing unpads by)."""
        pixels = image.rgb()
        out = self.processor(pixels, return_tensors="np")
        frames = np.asarray(out["pixel_values"], dtype=np.float32)[0].transpose(0, 2, 3, 1)
        height, width = (int(v) for v in np.asarray(out["image_sizes"])[0])
        rows, columns = self.grid(height, width)
        if frames.shape[1:3] != (self.tile_pixels, self.tile_pixels):
            raise VisionUnavailableError(
                f"the folder's image processor makes {frames.shape[2]}x{frames.shape[1]} px "
                f"tiles; the tower takes {self.tile_pixels}x{self.tile_pixels}")
        if frames.shape[0] != 1 + rows * columns:
            raise ValueError(f"the image processor made {frames.shape[0]} frames where the "
                             f"{rows}x{columns} grid needs {1 + rows * columns}")
        return frames, (height, width)

    # ---- engine thread ----------------------------------------------------------------------

    def encode(self, pixels: tuple[np.ndarray, tuple[int, int]]) -> Any:
        import mlx.core as mx

        frames, (height, width) = pixels
        *_, hidden_states = self.tower(mx.array(frames).astype(self.dtype),
                                       output_hidden_states=True)
        features = self.projector(hidden_states[self.feature_layer][:, 1:])  # no class token
        base, tiles = features[0], features[1:]
        rows, columns = self.grid(height, width)
        side, hidden = self.tile_patches, features.shape[-1]
        # Tiles (row, column) of patches (y, x) -> one map of rows * side x columns * side.
        grid = tiles.reshape(rows, columns, side, side, hidden).transpose(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * side, columns * side, hidden)
        kept_rows, kept_columns, top, left = self.feature_map(height, width)
        grid = grid[top:top + kept_rows, left:left + kept_columns]
        newlines = mx.broadcast_to(self.newline.astype(grid.dtype), (kept_rows, 1, hidden))
        grid = mx.concatenate([grid, newlines], axis=1).reshape(-1, hidden)
        return mx.concatenate([base, grid], axis=0)


__all__ = ["LlavaNextVision", "unpadded_size"]
