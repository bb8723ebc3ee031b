"""Qwen2-VL and Qwen2.5-VL vision: mlx-vlm's dynamic-resolution ViT (its patch merger is the
projector), and the language model's 3-D multimodal rotary positions.

Prompt: an image placeholder (the `<|vision_start|>` token) becomes `<|vision_start|>`, one
`<|image_pad|>` per merged 2x2 patch, `<|vision_end|>`. The image is resized to multiples of
28 px within the folder's min/max pixels (HF's `smart_resize`), so the token count follows the
image's size: a grid of (1, h, w) image tokens. Pixels are cut into 14 px patches as mlx-vlm's
torch-free port of the Qwen image processor does (`Qwen3VLImageProcessor`, used here as is).

Positions: Qwen's language model rotates each token by (t, h, w) positions, as mlx-vlm's
`get_rope_index` computes them: text tokens count up by one in all three; the tokens of an image
take `p + (0, row, column)` where p is the next text position; the text after the image starts
at `p + max(h, w)`. So an image of n = h * w tokens advances the positions by max(h, w) only,
and every token after it sits at `index + delta` (delta < 0). `positions()` computes the whole
prompt's [3, T] array in NumPy on the caller's thread; a generated token i sits at
i + `VisionPrompt.position_delta`.

Which language model runs it, and why: the engine keeps mlx-lm's class for the folder (mlx-lm's
`qwen2_vl`, a plain `qwen2` model, the one text requests use) with its normal caches, and
rewind.vision.mrope swaps each attention layer's 1-D rope for one that rotates by the positions
the engine passes (rewind.engine.positions). mlx-vlm's own LanguageModel was not used: it keeps
the rope deltas of the last prompt on the model instance (`_rope_deltas`, `_position_ids`), which
cannot serve a continuous batch of different prompts, and it would load the language weights a
second time or replace the class the rest of the engine (prompt cache, batching) is built on.
The rotation math is mlx-vlm's (`MRoPERotaryEmbedding`, "chunked" sections), so the logits equal
mlx-vlm's whole model's (tests/test_vision_qwen.py checks this).

Because positions come from the prompt layout, not from the cache: a restore that stops anywhere
(inside an image span too) prefills the rest with the same positions; decode after an image
uses index + delta per row of the batch; the next turn's prompt (the answer appended) gives the
answer tokens the positions they were decoded at. The prompt cache keys already fold in the
image hashes, and a token's positions depend only on the tokens and images before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.images import DecodedImage
from rewind.vision.family import (
    ImageLayout,
    ImageSpan,
    VisionFamily,
    VisionUnavailableError,
    image_size,
    vlm_model_config,
)


def mrope_positions(total: int, spans: Sequence[ImageSpan]) -> np.ndarray:
    """[3, total] int32 rotary positions of a prompt with these image spans (in order), as
    mlx-vlm's Qwen `get_rope_index` computes them for images."""
    positions = np.empty((3, total), dtype=np.int32)
    index = 0  # next prompt index
    current = 0  # next text position
    for span in spans:
        if span.grid is None:
            raise ValueError("an image span without its grid")
        text = span.start - index
        positions[:, index:span.start] = current + np.arange(text, dtype=np.int32)
        current += text
        t, h, w = span.grid
        if t * h * w != span.end - span.start:
            raise ValueError(f"an image grid {span.grid} for a span of {span.end - span.start}")
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                             indexing="ij")
        positions[:, span.start:span.end] = current + np.stack(
            [grid_t.ravel(), grid_h.ravel(), grid_w.ravel()]).astype(np.int32)
        current += max(t, h, w)
        index = span.end
    positions[:, index:] = current + np.arange(total - index, dtype=np.int32)
    return positions


def mrope_section_of(config: dict[str, Any]) -> list[int]:
    text = config.get("text_config") or {}
    for source in (text, config):
        for key in ("rope_scaling", "rope_parameters"):
            section = (source.get(key) or {}).get("mrope_section")
            if section:
                return [int(s) for s in section]
    raise VisionUnavailableError("the config has no mrope_section (rope_scaling)")


class QwenVLVision(VisionFamily):
    name = "Qwen2-VL / Qwen2.5-VL"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    rope_style = "chunked"  # how mlx-vlm's Qwen2/2.5-VL language models lay out the sections

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
            Qwen3VLImageProcessor,
            _qwen_vl_image_kwargs,
        )

        super().__init__(path, config, dtype, tokenizer)
        self.model_config = vlm_model_config(config)
        vision = self.model_config.vision_config
        self.merge_size = int(vision.spatial_merge_size)
        self.image_token_id = int(config["image_token_id"])
        self.vision_start_id = int(config["vision_start_token_id"])
        self.vision_end_id = int(config["vision_end_token_id"])
        self.placeholder_id = self.vision_start_id
        self.mrope_section = mrope_section_of(config)
        kwargs = _qwen_vl_image_kwargs(str(self.path), default_patch_size=int(vision.patch_size))
        kwargs.setdefault("merge_size", self.merge_size)
        kwargs.setdefault("temporal_patch_size", int(vision.temporal_patch_size))
        self.processor = Qwen3VLImageProcessor(**kwargs)
        self.tower = self._load()

    def _load(self) -> Any:
        import importlib

        module = importlib.import_module(f"mlx_vlm.models.{self.config['model_type']}.vision")
        tower = module.VisionModel(self.model_config.vision_config)
        weights = self.load_weights(["vision_tower."])["vision_tower."]
        tower.load_weights(list(tower.sanitize(weights).items()), strict=True)
        self.finish_modules(tower)
        return tower

    # ---- caller's thread --------------------------------------------------------------------

    def grid(self, image: DecodedImage) -> tuple[int, int, int]:
        """(t, h, w) image tokens: the resized image's patches, merged merge_size^2 to one."""
        width, height = image_size(image)
        resized_h, resized_w = self.processor._resolved_size(height, width)
        step = self.processor.patch_size * self.merge_size
        return 1, resized_h // step, resized_w // step

    def layout(self, image: DecodedImage) -> ImageLayout:
        grid = self.grid(image)
        return ImageLayout([self.vision_start_id], grid[0] * grid[1] * grid[2],
                           [self.vision_end_id], grid)

    def preprocess(self, image: DecodedImage) -> tuple[np.ndarray, np.ndarray]:
        """(patches [patches, C * temporal * patch * patch], grid_thw [1, 3] in patches)."""
        out = self.processor([image.rgb()])
        return np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"])

    def positions(self, tokens: Sequence[int], spans: Sequence[ImageSpan]) -> np.ndarray:
        return mrope_positions(len(tokens), spans)

    # ---- engine thread ----------------------------------------------------------------------

    def encode(self, pixels: tuple[np.ndarray, np.ndarray]) -> Any:
        import mlx.core as mx

        patches, grid_thw = pixels
        return self.tower(mx.array(patches).astype(self.dtype), mx.array(grid_thw),
                          output_hidden_states=False)

    def prepare_language_model(self, model: Any) -> None:
        from rewind.vision.mrope import install_mrope

        language = getattr(model, "language_model", model)
        install_mrope(model, language.model.layers, self.mrope_section, self.rope_style)


class Qwen35Vision(QwenVLVision):
    """Qwen 3.5 vision: Qwen3-VL's ViT (no deepstack in 3.5) before the hybrid language model
    (gated-delta linear attention + full attention; only the full-attention layers have
    positions). The same prompt layout and positions as Qwen2.5-VL; mrope's sections are
    interleaved over the rotary pairs, and only part of each head is rotated."""

    name = "Qwen 3.5"
    model_types = ("qwen3_5",)
    rope_style = "interleaved"

    def encode(self, pixels: tuple[np.ndarray, np.ndarray]) -> Any:
        import mlx.core as mx

        patches, grid_thw = pixels
        hidden, _deepstack = self.tower(mx.array(patches).astype(self.dtype), mx.array(grid_thw))
        return hidden


class Qwen3VLVision(Qwen35Vision):
    """Qwen3-VL (dense, and MoE where mlx-lm's qwen3_vl_moe holds the language model): Qwen
    3.5's ViT, prompt layout and interleaved 3-D positions before a qwen3 (or qwen3_moe)
    language model, plus "deepstack": the outputs of some ViT blocks, merged like the final
    features, are added to the hidden states after the language model's first layers at the
    image tokens (one ViT block per layer, in order), as mlx-vlm's `Qwen3VLModel` does.

    The engine takes those through rewind.engine.residuals: `prepare_language_model` lets the
    first layers take residuals, and the prompt's `residuals(start, end)` gives them per prefill
    chunk, sliced by offset like the embeddings (so a restore inside an image span adds the
    rest of it). The tower output kept in the feature LRU is one array, [image tokens,
    hidden * (1 + deepstack layers)]: the input embeddings, then each layer's features."""

    name = "Qwen3-VL"
    model_types = ("qwen3_vl", "qwen3_vl_moe")

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        super().__init__(path, config, dtype, tokenizer)
        self.residual_layers = len(self.model_config.vision_config.deepstack_visual_indexes)
        self.hidden_size = int(self.model_config.text_config.hidden_size)

    def encode(self, pixels: tuple[np.ndarray, np.ndarray]) -> Any:
        import mlx.core as mx

        patches, grid_thw = pixels
        hidden, deepstack = self.tower(mx.array(patches).astype(self.dtype), mx.array(grid_thw))
        return mx.concatenate([hidden, *deepstack], axis=-1)

    def to_embeddings(self, features: Any) -> Any:
        return features[:, :self.hidden_size]

    def layer_residuals(self, features: Any) -> list[Any]:
        width = self.hidden_size
        return [features[:, width * (layer + 1):width * (layer + 2)]
                for layer in range(self.residual_layers)]

    def prepare_language_model(self, model: Any) -> None:
        from rewind.engine.residuals import install_layer_residuals

        super().prepare_language_model(model)  # mrope, and MLX's layers instead of the kernels
        language = getattr(model, "language_model", model)
        layers = language.model.layers
        if self.residual_layers > len(layers):
            raise VisionUnavailableError(f"{self.residual_layers} deepstack layers for a "
                                         f"language model of {len(layers)}")
        install_layer_residuals(model, layers[:self.residual_layers])
