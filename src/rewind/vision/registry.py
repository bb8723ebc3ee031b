"""Every supported vision family, by `model_type`: the one module that imports the families."""

from __future__ import annotations

from typing import Any

from rewind.vision.family import VisionFamily, VisionUnavailableError
from rewind.vision.gemma3 import Gemma3Vision
from rewind.vision.gemma4 import Gemma4Vision
from rewind.vision.idefics3 import Idefics3Vision
from rewind.vision.llava import LlavaVision
from rewind.vision.llava_next import LlavaNextVision
from rewind.vision.pixtral import Mistral3Vision, PixtralVision
from rewind.vision.qwen_vl import Qwen3VLVision, Qwen35Vision, QwenVLVision


def families() -> list[type[VisionFamily]]:
    return [Gemma3Vision, Gemma4Vision, QwenVLVision, Qwen35Vision, Qwen3VLVision, LlavaVision,
            LlavaNextVision, PixtralVision, Mistral3Vision, Idefics3Vision]
def supported_model_types() -> tuple[str, ...]:
    return tuple(t for family in families() for t in family.model_types)


def family_for(model_type: Any) -> type[VisionFamily]:
    for family in families():
        if model_type in family.model_types:
            return family
    names = "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in families())
    raise VisionUnavailableError(
        f"vision model type {model_type!r} is not supported (supported: {names}); its text "
        "path still works without images")
