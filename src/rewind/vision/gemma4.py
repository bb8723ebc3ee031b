"""Gemma 4 vision (`gemma4`): mlx-vlm's Gemma 4 tower and multimodal embedder before mlx-lm's
gemma4 language model.

Prompt: the image placeholder is the image token itself (`<|image|>`). It becomes BOI, the
image's soft tokens, EOI (`<|image>`, n x `<|image|>`, `<image|>`), as Gemma 4's processors
(mlx-vlm's and transformers') write it. n follows the image's size: the processor resizes the
image, keeping its aspect ratio, to the largest size whose sides are whole multiples of
pooling x patch pixels (48 px for the released models: 16 px patches pooled 3x3) and that holds
at most max_soft_tokens x pooling^2 patches (280 soft tokens by default); n is the pooled patch
count, (height / 48) x (width / 48). Pixels are rescaled to [0, 1] and not normalized (the tower
maps them to [-1, 1]); mlx-vlm's image processor (PIL/NumPy) is used as is.

The tower (mlx-vlm's VisionModel) patchifies the image itself and adds its 2-D position
embeddings, attends bidirectionally over the image's patches, pools each 3x3 block into a soft
token and scales it by sqrt(tower width); the embedder (mlx-vlm's MultimodalEmbedder: RMS norm
without scale, linear) maps it to the language model's width.

Two things differ from feeding plain token embeddings, both as mlx-vlm's Gemma 4 does them:

- Scale: the language model multiplies its input embeddings by embed_scale = sqrt(hidden); mlx-vlm
  scales the text embeddings itself and inserts the image features unscaled. mlx-lm's gemma4
  scales every input embedding it is given, so features go in divided by sqrt(hidden).
- Per-layer inputs (PLE, `hidden_size_per_layer_input` > 0, the E2B/E4B models): every layer adds
  a projection of a per-token embedding looked up by token id. mlx-vlm looks them up with the
  image (and audio, video) token ids replaced by 0; mlx-lm's gemma4 looks them up from the ids
  it is called with. So image prompts hand the language model those ids
  (`language_model_ids`, GenerationRequest.model_tokens) while the cache keys keep the real
  tokens.

Positions are the plain 1-D ones. Not matched: folders whose `text_config` sets
`use_bidirectional_attention: "vision"` let an image's tokens attend to each other in both
directions (transformers on the sliding-window layers; mlx-vlm on every layer, when its
processor's token types reach the model, and it prefills such prompts in one piece); Rewind
attends causally, as it prefills in chunks and restores from the prompt cache at any block. A
warning says so when such a folder is loaded. Folders that leave it unset (the small models with
per-layer inputs) are causal everywhere. Audio and video are not served (the server takes no
audio or video parts); text requests take the plain text path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.images import DecodedImage
from rewind.vision.family import ImageLayout, VisionFamily, image_size, vlm_model_config

log = logging.getLogger(__name__)

# The clipping bounds of the tower's linear layers, kept only when the config uses them (as
# mlx-vlm's Gemma 4 sanitize does).
_CLIP_BOUNDS = ("input_max", "input_min", "output_max", "output_min")
# The image processor settings Gemma 4's processor reads from a flat preprocessor_config.json.
_FLAT_KEYS = ("patch_size", "max_soft_tokens", "pooling_kernel_size", "do_resize", "do_rescale",
              "do_normalize", "rescale_factor", "image_mean", "image_std", "size")


def image_processor_config(path: Path) -> dict[str, Any]:
    """The image processor's settings, found as mlx-vlm's Gemma4Processor.from_pretrained finds
    them: processor_config.json (else preprocessor_config.json), its `image_processor` entry or,
    for a flat file, the image keys."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (path / name).exists():
            config = json.loads((path / name).read_text())
            break
    else:
        return {}
    if isinstance(config.get("image_processor"), dict):
        settings = dict(config["image_processor"])
        settings.pop("image_processor_type", None)
        return settings
    if "image_processor_type" not in config and any(
            key in config for key in ("patch_size", "max_soft_tokens", "pooling_kernel_size")):
        return {key: config[key] for key in _FLAT_KEYS if key in config}
    return {}


class Gemma4Vision(VisionFamily):
    name = "Gemma 4"
    model_types = ("gemma4",)

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor

        super().__init__(path, config, dtype, tokenizer)
        self.model_config = vlm_model_config(config)
        model_config = self.model_config
        self.image_token_id = int(model_config.image_token_id)
        self.placeholder_id = self.image_token_id
        self.boi_token_id = int(model_config.boi_token_id)
        self.eoi_token_id = int(model_config.eoi_token_id)
        # The ids whose per-layer inputs mlx-vlm's Gemma 4 looks up as id 0.
        self.multimodal_ids = frozenset(
            int(i) for i in (model_config.image_token_id, model_config.audio_token_id,
                             getattr(model_config, "video_token_id", None)) if i is not None)
        text = model_config.text_config
        self.embed_scale = float(text.hidden_size) ** 0.5
        self.per_layer_inputs = bool(text.hidden_size_per_layer_input)
        if getattr(text, "use_bidirectional_attention", None) == "vision":
            log.warning("%s: Gemma 4 attends bidirectionally among an image's tokens "
                        "(use_bidirectional_attention='vision'); Rewind attends causally, so "
                        "answers about images may differ from mlx-vlm's and transformers'",
                        self.path.name)
        self.processor = Gemma4ImageProcessor(**image_processor_config(self.path))
        self.tower, self.embedder = self._load()

    def _load(self) -> tuple[Any, Any]:
        from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
        from mlx_vlm.models.gemma4.vision import VisionModel

        vision = self.model_config.vision_config
        weights = self.load_weights(["vision_tower.", "embed_vision."])
        tower_weights = {name: value for name, value in weights["vision_tower."].items()
                         if "rotary_emb" not in name
                         and (vision.use_clipped_linears
                              or not name.endswith(_CLIP_BOUNDS))}
        tower = VisionModel(vision)
        tower.load_weights(list(tower.sanitize(tower_weights).items()), strict=True)
        embedder = MultimodalEmbedder(vision.hidden_size, self.model_config.text_config.hidden_size,
                                      eps=vision.rms_norm_eps)
        embedder.load_weights(list(weights["embed_vision."].items()), strict=True)
        self.finish_modules(tower, embedder)
        return tower, embedder

    # ---- caller's thread --------------------------------------------------------------------

    @property
    def token_pixels(self) -> int:
        """Pixels per soft token along each side of the resized image."""
        return int(self.processor.patch_size) * int(self.processor.pooling_kernel_size)

    def resized(self, image: DecodedImage) -> tuple[int, int]:
        """(height, width) the processor resizes this image to."""
        from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        width, height = image_size(image)
        if not self.processor.do_resize:
            return height, width
        pooling = int(self.processor.pooling_kernel_size)
        return get_aspect_ratio_preserving_size(
            height, width, int(self.processor.patch_size),
            int(self.processor.max_soft_tokens) * pooling ** 2, pooling)

    def layout(self, image: DecodedImage) -> ImageLayout:
        height, width = self.resized(image)
        patch, pooling = int(self.processor.patch_size), int(self.processor.pooling_kernel_size)
        count = (height // patch) * (width // patch) // pooling ** 2
        return ImageLayout([self.boi_token_id], count, [self.eoi_token_id])

    def preprocess(self, image: DecodedImage) -> np.ndarray:
        """The tower's input [3, H, W] float32: resized, rescaled (mlx-vlm's image processor).
        The tower computes the patches' positions from H and W."""
        data, _ = self.processor.preprocess([image.rgb()])
        pixels = data["pixel_values"]
        return np.asarray(pixels[0], dtype=np.float32)

    def language_model_ids(self, tokens: Sequence[int]) -> list[int] | None:
        # mlx-vlm's get_input_embeddings: per-layer inputs from the ids with image, audio and
        # video tokens as 0 (mlx-lm's gemma4 reads them from the ids it is called with).
        if not self.per_layer_inputs:
            return None
        return [0 if token in self.multimodal_ids else token for token in tokens]

    # ---- engine thread ----------------------------------------------------------------------

    def encode(self, pixels: np.ndarray) -> Any:
        import mlx.core as mx

        features = self.tower(mx.array(pixels[None]).astype(self.dtype))
        return self.embedder(features)[0]

    def to_embeddings(self, features: Any) -> Any:
        return features / self.embed_scale


__all__ = ["Gemma4Vision", "image_processor_config"]
