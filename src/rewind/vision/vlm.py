"""Vision models through mlx-vlm: the tower and projector, and the adapter that turns a prompt
with image placeholders plus its images into the input embeddings of the language model.

Only the vision side comes from mlx-vlm. The language model is the one the engine already runs
(mlx-lm's class for the same folder: mlx-lm's `gemma3` keeps `language_model.*` and drops the
tower), with its normal mlx-lm caches, so an image prompt is prefilled, cached, restored and
batched exactly like a text prompt; only its prefill chunks take embeddings instead of token ids.

Supported family: Gemma 3 (SigLIP tower, a fixed number of image tokens per image; the language
model has sliding-window and global layers, which the prompt cache handles). Families whose
language model needs more than embeddings for an image (Qwen2-VL's 3-D rotary positions) are
refused with a clear error rather than run wrongly.

Threads: `VisionPrompt` and `preprocess` are plain Python/NumPy (built on a server thread);
`features` and the embedding function run on the engine thread, the only one that creates or
evaluates MLX arrays for the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.features import FeatureLRU
from rewind.vision.images import DecodedImage, ImageError

SUPPORTED_MODEL_TYPES = ("gemma3",)

EmbedFn = Callable[[int, int], Any]  # (start, end) -> input embeddings [1, end - start, hidden]


class VisionUnavailableError(RuntimeError):
    """The folder is a vision model, but mlx-vlm is missing or the family is not supported."""


def is_vision_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


def gemma3_vlm_config(config: dict[str, Any]) -> Any:
    """mlx-vlm's Gemma 3 ModelConfig with its nested text and vision configs built, as
    mlx_vlm.utils.load_model does."""
    from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig

    model_config = ModelConfig.from_dict(config)
    model_config.text_config = TextConfig.from_dict(config["text_config"])
    model_config.vision_config = VisionConfig.from_dict(config["vision_config"])
    return model_config


@dataclass(frozen=True)
class ImageSpan:
    """The image tokens of one image: prompt positions [start, end)."""

    start: int
    end: int
    image: DecodedImage


@dataclass
class VisionPrompt:
    """A prompt whose image placeholders were expanded into image-token spans."""

    tokens: list[int]
    spans: list[ImageSpan]
    # (old position, added tokens) for each expanded placeholder, to move checkpoint positions.
    shifts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def image_hashes(self) -> list[tuple[int, int, bytes]]:
        """For rewind.cache.BlockExtras: each span with the SHA-256 of its image's bytes."""
        return [(span.start, span.end, span.image.sha256) for span in self.spans]

    @property
    def image_tokens(self) -> int:
        return sum(span.end - span.start for span in self.spans)

    def position(self, old: int) -> int:
        """A position in the unexpanded prompt -> the same place in the expanded one."""
        return old + sum(added for at, added in self.shifts if at < old)


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


class VisionAdapter:
    """One vision model folder's tower + projector, its prompt expansion, and feature reuse."""

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any,
                 features: FeatureLRU | None = None) -> None:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise VisionUnavailableError(
                f"vision model type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); its text path still works without images")
        try:
            import mlx_vlm  # noqa: F401
        except ImportError as exc:
            raise VisionUnavailableError(
                "this is a vision model but mlx-vlm is not installed: pip install "
                "'rewind-engine[vision]' (text requests work without it)") from exc
        self.path = Path(path)
        self.config = config
        self.dtype = dtype
        self.feature_cache = features if features is not None else FeatureLRU()
        self.model_config = gemma3_vlm_config(config)
        text = config["text_config"]
        self.hidden_size = int(text["hidden_size"])
        self.tokens_per_image = int(text.get("mm_tokens_per_image",
                                             config.get("mm_tokens_per_image", 256)))
        self.image_token_id = int(config["image_token_index"])
        self.boi_token_id = int(config["boi_token_index"])
        self.eoi_token_id = int(config["eoi_token_index"])
        self.preprocessing = Preprocessing.from_folder(self.path,
                                                       self.model_config.vision_config.image_size)
        self.tower, self.projector = self._load_modules()
        # Gemma 3's processor puts "\n\n" on each side of an image; set from the tokenizer.
        self.newline_ids: list[int] = []
        self.tower_runs = 0  # how many images went through the tower (the rest came from the LRU)

    # ---- loading ---------------------------------------------------------------------------

    def _load_modules(self) -> tuple[Any, Any]:
        import mlx.core as mx
        from mlx.utils import tree_map
        from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector
        from mlx_vlm.models.gemma3.vision import VisionModel

        tower = VisionModel(self.model_config.vision_config)
        projector = Gemma3MultiModalProjector(self.model_config)
        tower_weights: dict[str, Any] = {}
        projector_weights: dict[str, Any] = {}
        for weight_file in sorted(self.path.glob("*.safetensors")):
            for name, value in mx.load(str(weight_file)).items():
                if name.startswith("vision_tower."):
                    tower_weights[name[len("vision_tower."):]] = value
                elif name.startswith("multi_modal_projector."):
                    projector_weights[name[len("multi_modal_projector."):]] = value
        if not tower_weights:
            raise VisionUnavailableError(f"{self.path} has no vision_tower.* weights")
        if any(name.endswith(".scales") for name in [*tower_weights, *projector_weights]):
            raise VisionUnavailableError("quantized vision towers are not supported; convert "
                                         "the model with its vision tower unquantized")
        tower.load_weights(list(tower.sanitize(tower_weights).items()), strict=True)
        projector.load_weights(list(projector_weights.items()), strict=True)
        for module in (tower, projector):
            module.update(tree_map(lambda v: v.astype(self.dtype)
                                   if mx.issubdtype(v.dtype, mx.floating) else v,
                                   module.parameters()))
            mx.eval(module.parameters())
        return tower, projector

    # ---- caller's thread: plain data ---------------------------------------------------------

    def expand(self, tokens: Sequence[int], images: Sequence[DecodedImage]) -> VisionPrompt:
        """Replace each image placeholder (the begin-of-image token) with the model's full image
        sequence: [newline] BOI, tokens_per_image image tokens, EOI [newline], as Gemma 3's
        processor does. The i-th placeholder takes the i-th image."""
        placeholders = sum(1 for t in tokens if t == self.boi_token_id)
        if placeholders != len(images):
            raise ImageError(f"the prompt has {placeholders} image placeholder(s) but "
                             f"{len(images)} image(s) were sent")
        if any(t == self.image_token_id for t in tokens):
            raise ImageError("the prompt contains the model's image token as text")
        out: list[int] = []
        spans: list[ImageSpan] = []
        shifts: list[tuple[int, int]] = []
        index = 0
        for position, token in enumerate(tokens):
            if token != self.boi_token_id:
                out.append(token)
                continue
            before = len(out)
            out.extend(self.newline_ids)
            out.append(self.boi_token_id)
            start = len(out)
            out.extend([self.image_token_id] * self.tokens_per_image)
            spans.append(ImageSpan(start, len(out), images[index]))
            out.append(self.eoi_token_id)
            out.extend(self.newline_ids)
            shifts.append((position, len(out) - before - 1))
            index += 1
        return VisionPrompt(out, spans, shifts)

    def known_image(self, sha256: bytes) -> bool:
        """True while this image's tower output is kept (its bytes need no decoding)."""
        return sha256 in self.feature_cache

    def preprocess(self, image: DecodedImage) -> np.ndarray:
        """RGB pixels -> the tower's input [H, W, 3] float32 (resized, rescaled, normalized)."""
        height, width = self.preprocessing.size
        resized = image.rgb().resize((width, height), resample=self.preprocessing.resample)
        pixels = np.asarray(resized, dtype=np.float32) * self.preprocessing.rescale
        mean = np.asarray(self.preprocessing.mean, dtype=np.float32)
        std = np.asarray(self.preprocessing.std, dtype=np.float32)
        return (pixels - mean) / std

    # ---- engine thread: MLX -----------------------------------------------------------------

    def features(self, image: DecodedImage, pixels: np.ndarray | None = None) -> Any:
        """The projected tower output [tokens_per_image, hidden] of one image, from the LRU when
        the same bytes were seen before."""
        import mlx.core as mx

        cached = self.feature_cache.get(image.sha256)
        if cached is not None:
            return cached
        if pixels is None:
            pixels = self.preprocess(image)
        hidden, _, _ = self.tower(mx.array(pixels[None]).astype(self.dtype),
                                  output_hidden_states=True)
        projected = self.projector(hidden)[0]
        mx.eval(projected)
        self.tower_runs += 1
        self.feature_cache.put(image.sha256, projected)
        return projected

    def embedder(self, prompt: VisionPrompt, embed_tokens: Callable[[Any], Any],
                 pixels: Sequence[np.ndarray] | None = None) -> EmbedFn:
        """(start, end) -> input embeddings of prompt positions [start, end) for the language
        model: token embeddings, with each image span's positions taken from its image's
        features. Any [start, end) works, including one that starts or ends inside an image span
        (a prompt-cache restore may stop there), because a span's features are sliced by offset.

        The values are those mlx-vlm's Gemma 3 builds: features divided by sqrt(hidden), since
        the language model multiplies every input embedding by sqrt(hidden)."""
        import mlx.core as mx

        scale = self.hidden_size ** 0.5
        per_image: dict[int, Any] = {}

        def scaled_features(index: int) -> Any:
            if index not in per_image:
                span = prompt.spans[index]
                raw = self.features(span.image, None if pixels is None else pixels[index])
                per_image[index] = raw / scale
            return per_image[index]

        def embed(start: int, end: int) -> Any:
            hidden = embed_tokens(mx.array([prompt.tokens[start:end]]))
            for index, span in enumerate(prompt.spans):
                lo, hi = max(span.start, start), min(span.end, end)
                if lo >= hi:
                    continue
                piece = scaled_features(index)[lo - span.start:hi - span.start]
                hidden[:, lo - start:hi - start, :] = piece.astype(hidden.dtype)
            return hidden

        return embed


def text_embeddings(model: Any) -> Callable[[Any], Any]:
    """The language model's token embedding layer (mlx-lm's gemma3 keeps it under
    language_model.model)."""
    inner = getattr(model, "language_model", model)
    return inner.model.embed_tokens


def load_vision_adapter(path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any = None,
                        feature_budget_bytes: int | None = None) -> VisionAdapter | None:
    """The adapter for a vision model folder; None for a text-only folder."""
    if not is_vision_config(config):
        return None
    features = FeatureLRU(feature_budget_bytes) if feature_budget_bytes else FeatureLRU()
    adapter = VisionAdapter(path, config, dtype, features)
    if tokenizer is not None:
        adapter.newline_ids = list(tokenizer.encode("\n\n", add_special_tokens=False))
    return adapter


def adapter_for(loaded: Any, feature_budget_bytes: int | None = None) -> VisionAdapter | None:
    """The adapter for a rewind LoadedModel (its folder, config, compute dtype and tokenizer)."""
    if not is_vision_config(loaded.config):
        return None
    embed = text_embeddings(loaded.model)
    return load_vision_adapter(loaded.path, loaded.config, embed.weight.dtype, loaded.tokenizer,
                               feature_budget_bytes)
