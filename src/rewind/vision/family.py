"""The base types of a vision family: what a family module (gemma3, qwen_vl, ...) builds on.

They live here, apart from rewind.vision.vlm (the adapter that runs a family) and
rewind.vision.registry (which imports every family): a family imports only this module and
`images`, so no module of the package imports one that imports it back, and each one imports on
its own, in any order.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rewind.vision.images import DecodedImage


class VisionUnavailableError(RuntimeError):
    """The folder is a vision model, but mlx-vlm is missing or the family is not supported."""


def is_vision_config(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


def vlm_model_config(config: dict[str, Any]) -> Any:
    """mlx-vlm's ModelConfig for a folder's config.json, with its nested text and vision configs
    built as mlx_vlm.utils.load_model builds them."""
    import importlib

    from mlx_vlm.utils import update_module_configs

    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    config = json.loads(json.dumps(config))  # from_dict may change what it is given
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(config)
    return update_module_configs(model_config, module, config, ["text", "vision"])


@dataclass(frozen=True)
class ImageSpan:
    """The image tokens of one image: prompt positions [start, end)."""

    start: int
    end: int
    image: DecodedImage
    grid: tuple[int, int, int] | None = None  # (t, h, w) image tokens, for 3-D positions


@dataclass(frozen=True)
class ImageLayout:
    """What one image placeholder becomes: `before`, the image's span, then `after`.

    The span is `count` image tokens, or `tokens` where the family puts other tokens between
    them (Pixtral's row breaks): then `count` of `tokens` are the image token, they take the
    image's features in order, and the others keep their token embeddings. Either way the
    whole span carries the image's hash in cache keys."""

    before: list[int]
    count: int
    after: list[int]
    grid: tuple[int, int, int] | None = None
    tokens: list[int] | None = None


def image_size(image: DecodedImage) -> tuple[int, int]:
    """(width, height), from the header alone for an image kept undecoded."""
    if image.pixels is not None:
        return image.pixels.size
    from PIL import Image

    with Image.open(io.BytesIO(image.data)) as probe:
        return probe.size


class VisionFamily:
    """One family's vision side. Subclasses set the class attributes and the token ids, and
    implement `_load`, `layout`, `preprocess` and `encode`."""

    name = ""
    model_types: tuple[str, ...] = ()

    def __init__(self, path: Path, config: dict[str, Any], dtype: Any, tokenizer: Any) -> None:
        self.path = Path(path)
        self.config = config
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.placeholder_id: int = -1  # marks an image in an unexpanded prompt
        self.image_token_id: int = -1  # fills an image span
        # How many of the language model's first layers get image features added to their
        # outputs (Qwen3-VL's deepstack: `layer_residuals`); 0 for most families.
        self.residual_layers = 0

    # caller's thread: plain data
    def layout(self, image: DecodedImage) -> ImageLayout:
        raise NotImplementedError

    def preprocess(self, image: DecodedImage) -> Any:
        raise NotImplementedError

    def positions(self, tokens: Sequence[int], spans: Sequence[ImageSpan]) -> np.ndarray | None:
        """Rotary positions [3, len(tokens)] for families with 3-D positions; None otherwise."""
        return None

    # engine thread: MLX
    def encode(self, pixels: Any) -> Any:
        """Tower (+ projector) output for one preprocessed image: [image tokens, hidden]."""
        raise NotImplementedError

    def to_embeddings(self, features: Any) -> Any:
        """Features as the language model's input embeddings (the LRU keeps `features`)."""
        return features

    def language_model_ids(self, tokens: Sequence[int]) -> list[int] | None:
        """The token ids the language model's call gets, beside the input embeddings, for an
        image prompt's prefill chunks, where they must differ from the prompt's own; None (most
        families): the prompt's. The model uses the embeddings and ignores the ids, except where
        it computes something else from the ids: Gemma 4's per-layer inputs (PLE) are looked up
        by token id, and its own model reads them with each image token's id replaced by 0.
        Only what the model is given changes: cache keys stay on the real prompt tokens."""
        return None

    def layer_residuals(self, features: Any) -> list[Any]:
        """What is added to the outputs of layers 0 .. residual_layers - 1 at the image tokens:
        one [image tokens, hidden] per layer, from the same `features`."""
        return []

    def prepare_language_model(self, model: Any) -> None:
        """Adjust the language model the engine runs, once (e.g. multimodal rotary positions)."""

    # shared loading
    def load_weights(self, prefixes: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The folder's weights under each prefix (prefix stripped); refuses quantized towers."""
        import mlx.core as mx

        found: dict[str, dict[str, Any]] = {prefix: {} for prefix in prefixes}
        for weight_file in sorted(self.path.glob("*.safetensors")):
            for name, value in mx.load(str(weight_file)).items():
                for prefix in prefixes:
                    if name.startswith(prefix):
                        found[prefix][name[len(prefix):]] = value
        if not found[prefixes[0]]:
            raise VisionUnavailableError(f"{self.path} has no {prefixes[0]}* weights")
        if any(name.endswith(".scales") for weights in found.values() for name in weights):
            raise VisionUnavailableError("quantized vision towers are not supported; convert "
                                         "the model with its vision tower unquantized")
        return found

    def finish_modules(self, *modules: Any) -> None:
        """Cast to the compute dtype and evaluate."""
        import mlx.core as mx
        from mlx.utils import tree_map

        for module in modules:
            module.update(tree_map(lambda v: v.astype(self.dtype)
                                   if mx.issubdtype(v.dtype, mx.floating) else v,
                                   module.parameters()))
            mx.eval(module.parameters())
