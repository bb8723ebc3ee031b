"""Turn (prompt tokens with image placeholders, decoded images) into what the engine takes for an
image request: expanded tokens, moved checkpoint positions, cache extras with the image hashes,
and the embedding function for its prefill chunks (and the rotary positions where the family has 3-D
positions, and the per-layer additions where it has them: Qwen3-VL's deepstack).

Runs on the caller's thread and creates no MLX arrays: the NumPy preprocessing happens here, the
tower and embeddings later on the engine thread (rewind.vision.vlm).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rewind.cache.blocks import BlockExtras
from rewind.vision.images import DecodedImage
from rewind.vision.vlm import (
    EmbedFn,
    PositionsFn,
    ResidualsFn,
    VisionAdapter,
    VisionPrompt,
    text_embeddings,
)


@dataclass
class ImagePrompt:
    prompt: VisionPrompt
    checkpoints: list[int]
    extras: BlockExtras
    embed: EmbedFn
    # Families with 3-D rotary positions (Qwen-VL): positions of prompt tokens, and the shift
    # of every generated token's position (GenerationRequest.positions / position_delta).
    positions: PositionsFn | None = None
    position_delta: int = 0
    # Families that add image features after their first layers (Qwen3-VL's deepstack): what
    # goes to GenerationRequest.layer_residuals.
    residuals: ResidualsFn | None = None
    # Families whose language model must be given other ids than the prompt's for prefill
    # (Gemma 4: image tokens as 0 for its per-layer inputs): GenerationRequest.model_tokens.
    model_tokens: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt.tokens

    def into(self, request: Any) -> Any:
        """Fill a rewind.engine GenerationRequest's image fields (extras, embed, positions,
        position_delta, layer_residuals, model_tokens) with this prompt's; returns it."""
        request.extras, request.embed = self.extras, self.embed
        request.positions, request.position_delta = self.positions, self.position_delta
        request.layer_residuals = self.residuals
        request.model_tokens = self.model_tokens
        return request


def prepare_image_prompt(adapter: VisionAdapter, model: Any, tokens: Sequence[int],
                         images: Sequence[DecodedImage], checkpoints: Sequence[int] = (),
                         salt: str = "") -> ImagePrompt:
    """`tokens` hold one image placeholder (`adapter.placeholder_id`) per image, in order;
    `checkpoints` are positions in `tokens` (moved to the expanded prompt). Raises ImageError on
    a mismatch."""
    prompt = adapter.expand(tokens, images)
    moved = sorted({prompt.position(p) for p in checkpoints} | {len(prompt.tokens)})
    # Preprocess here (NumPy, off the engine thread) unless the tower output is already kept.
    pixels = [None if span.image.sha256 in adapter.feature_cache else adapter.preprocess(span.image)
              for span in prompt.spans]
    images = adapter.images(prompt, pixels)
    embed = adapter.embedder(images, text_embeddings(model))
    extras = BlockExtras(image_hashes=prompt.image_hashes, salt=salt)
    return ImagePrompt(prompt, moved, extras, embed, adapter.positioner(prompt),
                       prompt.position_delta, adapter.residuals(images),
                       adapter.family.language_model_ids(prompt.tokens))
