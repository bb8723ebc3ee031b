"""Vision models through mlx-vlm: the tower and projector, and the adapter that turns a prompt
with image placeholders plus its images into the input embeddings (and, for Qwen-VL-style
models, the rotary positions) of the language model.

Only the vision side comes from mlx-vlm. The language model is the one the engine already runs
(mlx-lm's class for the same folder, which drops the tower), with its normal mlx-lm caches, so an
image prompt is prefilled, cached, restored and batched exactly like a text prompt; only its
prefill chunks take embeddings instead of token ids (and explicit positions, or additions to
the first layers' outputs, where the family needs them).

A family is a small adapter chosen by `model_type` (`VisionFamily`): it loads the tower and
projector, says which tokens an image expands into, preprocesses pixels, runs the tower, and maps
features to input embeddings. Its base types are in rewind.vision.family and the list of families
in rewind.vision.registry, so a family module never imports this one (which imports the registry).
Supported families:

- Gemma 3 (rewind.vision.gemma3): SigLIP tower, 256 image tokens per image (a fixed count);
  sliding-window and global layers, which the prompt cache handles.
- Gemma 4 (rewind.vision.gemma4): a tower at the image's own aspect ratio, pooled to at most
  280 soft tokens by default; its language model's per-layer inputs are looked up with image
  tokens as id 0 (`VisionFamily.language_model_ids`, GenerationRequest.model_tokens).
- Qwen2-VL and Qwen2.5-VL (rewind.vision.qwen_vl): a dynamic-resolution ViT whose token count
  follows the image's size, and a language model with 3-D multimodal rotary positions: see
  rewind.vision.qwen_vl for how those reach mlx-lm's language model.
- Qwen 3.5 (rewind.vision.qwen_vl.Qwen35Vision): Qwen3-VL's ViT before the hybrid language model
  (gated-delta linear attention + full attention), with the same positions, interleaved.
- Qwen3-VL, dense and MoE (rewind.vision.qwen_vl.Qwen3VLVision): the same ViT and positions,
  and "deepstack" features added after the language model's first layers at the image tokens
  (`VisionFamily.layer_residuals`, per prefill chunk through `VisionAdapter.residuals` and
  rewind.engine.residuals).
- LLaVA (rewind.vision.llava): CLIP or SigLIP tower and projector before a llama; a fixed count
  of image tokens per image.
- LLaVA-NeXT (rewind.vision.llava_next): the same over the tiles of a grid picked by the
  image's aspect ratio and the whole image; the grid's features unpadded, a learned newline
  embedding after each row.
- Pixtral and Mistral 3 (rewind.vision.pixtral): the Pixtral tower at the image's own size; rows
  of image tokens with a break token between rows (other tokens inside an image's span, see
  `ImageLayout.tokens`).
- Idefics 3 and SmolVLM (rewind.vision.idefics3): a SigLIP-style tower over the image's tiles
  and a global tile, pixel-shuffled; each tile's image tokens behind its row/column marker.

Other vision folders are refused with an error that names these (`VisionUnavailableError`);
their text path still works.

Threads: `VisionPrompt` and `preprocess` are plain Python/NumPy (built on a server thread);
`features` and the embedding function run on the engine thread, the only one that creates or
evaluates MLX arrays for the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.family import ImageSpan, VisionUnavailableError, is_vision_config
from rewind.vision.features import FeatureLRU
from rewind.vision.images import DecodedImage, ImageError
from rewind.vision.registry import family_for

EmbedFn = Callable[[int, int], Any]  # (start, end) -> input embeddings [1, end - start, hidden]
PositionsFn = Callable[[int, int], Any]  # (start, end) -> rotary positions [3, 1, end - start]
# (start, end) -> {layer: [1, end - start, hidden]} added to those layers' outputs, or None
ResidualsFn = Callable[[int, int], Any]


@dataclass
class VisionPrompt:
    """A prompt whose image placeholders were expanded into image-token spans."""

    tokens: list[int]
    spans: list[ImageSpan]
    # (old position, added tokens) for each expanded placeholder, to move checkpoint positions.
    shifts: list[tuple[int, int]] = field(default_factory=list)
    # Families with multimodal rotary positions: [3, len(tokens)] int32; None: 1-D positions.
    positions: np.ndarray | None = None

    @property
    def image_hashes(self) -> list[tuple[int, int, bytes]]:
        """For rewind.cache.BlockExtras: each span with the SHA-256 of its image's bytes."""
        return [(span.start, span.end, span.image.sha256) for span in self.spans]

    @property
    def image_tokens(self) -> int:
        """Tokens the images' spans occupy (Pixtral's row breaks included)."""
        return sum(span.end - span.start for span in self.spans)

    @property
    def position_delta(self) -> int:
        """Token i >= len(tokens) (the answer) sits at position i + position_delta."""
        if self.positions is None or not self.tokens:
            return 0
        return int(self.positions[:, -1].max()) + 1 - len(self.tokens)

    def position(self, old: int) -> int:
        """A position in the unexpanded prompt -> the same place in the expanded one."""
        return old + sum(added for at, added in self.shifts if at < old)


class PromptImages:
    """One image prompt's images on the engine thread: each image's tower output, computed (or
    taken from the adapter's LRU) once however many chunks and uses ask for it."""

    def __init__(self, adapter: VisionAdapter, prompt: VisionPrompt,
                 pixels: Sequence[Any] | None) -> None:
        self.adapter = adapter
        self.prompt = prompt
        self.pixels = pixels
        self._features: dict[int, Any] = {}

    def features(self, index: int) -> Any:
        """[image tokens, ...] of the index-th image, checked against its span."""
        if index not in self._features:
            span = self.prompt.spans[index]
            raw = self.adapter.features(span.image,
                                        None if self.pixels is None else self.pixels[index])
            tokens = len(self.image_rows(index))
            if raw.shape[0] != tokens:
                raise ValueError(f"image {index} gave {raw.shape[0]} features for {tokens} "
                                 "image tokens")
            self._features[index] = raw
        return self._features[index]

    def image_rows(self, index: int) -> list[int]:
        """Offsets in the index-th span of its image tokens (all of them but where the family
        puts other tokens inside the span)."""
        span = self.prompt.spans[index]
        image_token = self.adapter.family.image_token_id
        return [i for i, token in enumerate(self.prompt.tokens[span.start:span.end])
                if token == image_token]

    def overlapping(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(image index, lo, hi) for each span overlapping prompt positions [start, end): its
        offsets [lo, hi) inside the span."""
        pieces = []
        for index, span in enumerate(self.prompt.spans):
            lo, hi = max(span.start, start), min(span.end, end)
            if lo < hi:
                pieces.append((index, lo - span.start, hi - span.start))
        return pieces


class VisionAdapter:
    """One vision model folder's family (tower, projector, prompt expansion) and feature reuse.

    Attributes the family defines (Gemma 3's `boi_token_id`, `newline_ids`, `tokens_per_image`,
    `preprocessing`, ...) are read through the adapter."""

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any,
                 features: FeatureLRU | None = None, tokenizer: Any = None) -> None:
        family_class = family_for(config.get("model_type"))
        try:
            import mlx_vlm  # noqa: F401
        except ImportError as exc:
            raise VisionUnavailableError(
                "this is a vision model but mlx-vlm is not installed: pip install "
                "'rewind-engine[vision]' (text requests work without it)") from exc
        self.family = family_class(Path(path), config, dtype, tokenizer)
        self.path = Path(path)
        self.config = config
        self.dtype = dtype
        self.feature_cache = features if features is not None else FeatureLRU()
        self.tower_runs = 0  # how many images went through the tower (the rest came from the LRU)

    def __getattr__(self, name: str) -> Any:
        if name == "family":  # not set yet (failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.family, name)

    @property
    def placeholder_id(self) -> int:
        return self.family.placeholder_id

    @property
    def image_token_id(self) -> int:
        return self.family.image_token_id

    # ---- caller's thread: plain data ---------------------------------------------------------

    def expand(self, tokens: Sequence[int], images: Sequence[DecodedImage]) -> VisionPrompt:
        """Replace each image placeholder with the family's image sequence (tokens before, the
        image tokens, tokens after). The i-th placeholder takes the i-th image."""
        placeholder = self.family.placeholder_id
        placeholders = sum(1 for t in tokens if t == placeholder)
        if placeholders != len(images):
            raise ImageError(f"the prompt has {placeholders} image placeholder(s) but "
                             f"{len(images)} image(s) were sent")
        image_token = self.family.image_token_id
        # Where the placeholder is the image token itself (LLaVA's <image>, Pixtral's [IMG]),
        # every occurrence is a placeholder and the count check above covers it.
        if placeholder != image_token and any(t == image_token for t in tokens):
            raise ImageError("the prompt contains the model's image token as text")
        out: list[int] = []
        spans: list[ImageSpan] = []
        shifts: list[tuple[int, int]] = []
        index = 0
        for position, token in enumerate(tokens):
            if token != placeholder:
                out.append(token)
                continue
            layout = self.family.layout(images[index])
            before = len(out)
            out.extend(layout.before)
            start = len(out)
            if layout.tokens is None:
                out.extend([image_token] * layout.count)
            else:
                if sum(1 for t in layout.tokens if t == image_token) != layout.count:
                    raise ValueError(f"an image layout of {layout.count} image tokens holds "
                                     "another number of them")
                out.extend(layout.tokens)
            spans.append(ImageSpan(start, len(out), images[index], layout.grid))
            out.extend(layout.after)
            shifts.append((position, len(out) - before - 1))
            index += 1
        return VisionPrompt(out, spans, shifts, self.family.positions(out, spans))

    def known_image(self, sha256: bytes) -> bool:
        """True while this image's tower output is kept (its bytes need no decoding)."""
        return sha256 in self.feature_cache

    def preprocess(self, image: DecodedImage) -> Any:
        """Pixels -> the tower's input (NumPy; the family's layout)."""
        return self.family.preprocess(image)

    # ---- engine thread: MLX -----------------------------------------------------------------

    def features(self, image: DecodedImage, pixels: Any = None) -> Any:
        """The tower (+ projector) output [image tokens, hidden] of one image, from the LRU when
        the same bytes were seen before."""
        import mlx.core as mx

        cached = self.feature_cache.get(image.sha256)
        if cached is not None:
            return cached
        if pixels is None:
            pixels = self.preprocess(image)
        projected = self.family.encode(pixels)
        mx.eval(projected)
        self.tower_runs += 1
        self.feature_cache.put(image.sha256, projected)
        return projected

    def images(self, prompt: VisionPrompt, pixels: Sequence[Any] | None = None
               ) -> PromptImages:
        """The prompt's images for `embedder` and `residuals` (each image's features are
        computed, or taken from the LRU, once for both); `pixels` are the preprocessed images
        in span order (None, or a None entry: preprocess when needed)."""
        return PromptImages(self, prompt, pixels)

    def embedder(self, images: PromptImages, embed_tokens: Callable[[Any], Any]) -> EmbedFn:
        """(start, end) -> input embeddings of prompt positions [start, end) for the language
        model: token embeddings, with each image span's positions taken from its image's
        features. Any [start, end) works, including one that starts or ends inside an image span
        (a prompt-cache restore may stop there), because a span's features are sliced by offset.
        """
        import mlx.core as mx

        prompt = images.prompt
        per_image: dict[int, Any] = {}

        def image_embeddings(index: int) -> Any:
            """[span length, hidden]: one row per position of the span."""
            if index not in per_image:
                embeddings = self.family.to_embeddings(images.features(index)).astype(self.dtype)
                span = prompt.spans[index]
                at = images.image_rows(index)
                if len(at) != span.end - span.start:  # other tokens inside the span keep theirs
                    rows = embed_tokens(mx.array(prompt.tokens[span.start:span.end]))
                    rows = rows.astype(self.dtype)
                    rows[mx.array(at)] = embeddings
                    embeddings = rows
                per_image[index] = embeddings
            return per_image[index]

        def embed(start: int, end: int) -> Any:
            # In the compute dtype: the table may be stored narrower (bf16 on the CPU, where the
            # C kernels read it in place); widening is exact.
            hidden = embed_tokens(mx.array([prompt.tokens[start:end]])).astype(self.dtype)
            for index, lo, hi in images.overlapping(start, end):
                at = prompt.spans[index].start - start  # the span's offset in this range
                hidden[:, lo + at:hi + at, :] = image_embeddings(index)[lo:hi].astype(hidden.dtype)
            return hidden

        return embed

    def residuals(self, images: PromptImages) -> ResidualsFn | None:
        """(start, end) -> {layer: [1, end - start, hidden]}: what the family adds to the
        outputs of its first layers at the image tokens of prompt positions [start, end)
        (Qwen3-VL's deepstack; zeros elsewhere), or None for a range without image tokens.
        Like `embedder`, any range works. None for families that add nothing and for prompts
        without images."""
        import mlx.core as mx

        if not self.family.residual_layers or not images.prompt.spans:
            return None
        prompt = images.prompt
        per_image: dict[int, list[Any]] = {}

        def image_residuals(index: int) -> list[Any]:
            """Per layer, [span length, hidden]: zero rows at the span's other tokens."""
            if index not in per_image:
                span = prompt.spans[index]
                at = images.image_rows(index)
                layers = []
                for features in self.family.layer_residuals(images.features(index)):
                    features = features.astype(self.dtype)
                    if len(at) != span.end - span.start:
                        rows = mx.zeros((span.end - span.start, features.shape[-1]), self.dtype)
                        rows[mx.array(at)] = features
                        features = rows
                    layers.append(features)
                per_image[index] = layers
            return per_image[index]

        def residuals(start: int, end: int) -> dict[int, Any] | None:
            pieces = images.overlapping(start, end)
            if not pieces:
                return None
            out: dict[int, Any] = {}
            for index, lo, hi in pieces:
                at = prompt.spans[index].start - start
                for layer, features in enumerate(image_residuals(index)):
                    if layer not in out:
                        out[layer] = mx.zeros((1, end - start, features.shape[-1]), self.dtype)
                    out[layer][:, lo + at:hi + at, :] = features[lo:hi]
            return out

        return residuals

    def positioner(self, prompt: VisionPrompt) -> PositionsFn | None:
        """(start, end) -> rotary positions [3, 1, end - start] of those prompt tokens, for
        families with 3-D positions; None for the others."""
        if prompt.positions is None:
            return None
        positions = prompt.positions

        def at(start: int, end: int) -> Any:
            import mlx.core as mx

            return mx.array(positions[:, None, start:end])

        return at


def text_embeddings(model: Any) -> Callable[[Any], Any]:
    """The language model's token embedding layer (mlx-lm's vision-folder classes keep it under
    language_model.model)."""
    inner = getattr(model, "language_model", model)
    return inner.model.embed_tokens


def load_vision_adapter(path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any = None,
                        feature_budget_bytes: int | None = None) -> VisionAdapter | None:
    """The adapter for a vision model folder; None for a text-only folder."""
    if not is_vision_config(config):
        return None
    features = FeatureLRU(feature_budget_bytes) if feature_budget_bytes else FeatureLRU()
    return VisionAdapter(path, config, dtype, features, tokenizer)


def adapter_for(loaded: Any, feature_budget_bytes: int | None = None) -> VisionAdapter | None:
    """The adapter for a rewind LoadedModel (its folder, config, compute dtype and tokenizer).
    Prepares the loaded language model for image prompts where the family needs it (Qwen-VL's
    multimodal rotary positions)."""
    if not is_vision_config(loaded.config):
        return None
    from rewind.models.loader import compute_dtype

    adapter = load_vision_adapter(loaded.path, loaded.config, compute_dtype(), loaded.tokenizer,
                                  feature_budget_bytes)
    if adapter is not None:
        adapter.family.prepare_language_model(loaded.model)
    return adapter
