"""Rewind keeps its state on objects it owns (issue 24): a model loaded through Rewind's load path,
of every family and before and after it generates, carries no attribute of ours on mlx-lm's
modules, and no class in it runs a copy of mlx-lm's code with other globals."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.models.loader import load_model

TIMEOUT = 120


def foreign_state(model: Any) -> list[str]:
    """What of ours sits on the model's modules: `_rewind_` names in their instance dicts,
    children or classes, and methods whose globals are not their own module's (copied code)."""
    found = []
    for path, module in model.named_modules():
        where = f"{path or '<model>'} ({type(module).__name__})"
        names = [*vars(module), *module.keys()]
        for cls in type(module).__mro__:
            names += list(vars(cls))
            for attr, function in vars(cls).items():
                if not isinstance(function, types.FunctionType):
                    continue
                home = sys.modules.get(function.__globals__.get("__name__", ""))
                if home is None or function.__globals__ is not vars(home) or (
                        function.__code__.co_filename != getattr(home, "__file__", None)):
                    found.append(f"{where}: {cls.__qualname__}.{attr} runs code of "
                                 f"{function.__code__.co_filename} with copied globals")
        found += [f"{where}: {name}" for name in names
                  if isinstance(name, str) and name.startswith("_rewind_")]
    return sorted(set(found))


def generate_a_little(loaded: Any, request: GenerationRequest) -> None:
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        result = engine.generate(request, TIMEOUT)
    assert result.tokens


@pytest.mark.parametrize("family, native", [
    ("llama", None), ("gemma3", None), ("qwen3_5", None), ("gemma4", None),
    # MLX's layers on the CPU: attention routed to the kernel, Gemma's vectorized GELU.
    ("llama", "off"), ("gemma3", "off"),
])
def test_a_text_model_carries_nothing_of_ours(tiny_model_path, family: str,
                                              native: str | None) -> None:
    loaded = load_model(str(tiny_model_path(family)), native_forward=native)
    assert foreign_state(loaded.model) == []
    generate_a_little(loaded, GenerationRequest([1, 2, 3, 4], SamplingParams(max_tokens=3)))
    assert foreign_state(loaded.model) == []


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_model_carries_nothing_of_ours(tmp_path: Path, model_type: str) -> None:
    """Qwen-VL: 3-D rotary positions (and Qwen3-VL's deepstack layer residuals) are set up
    and used by an image prompt."""
    pytest.importorskip("mlx_vlm")
    pytest.importorskip("PIL")
    from vision_helpers import generation, image_prompt, picture

    from rewind.engine.positions import takes_positions
    from rewind.engine.residuals import takes_residuals
    from rewind.testing.tiny_qwen_vl import build_tiny_qwen_vl_model
    from rewind.vision.vlm import adapter_for

    loaded = load_model(str(build_tiny_qwen_vl_model(tmp_path / model_type, model_type)))
    vision = (loaded, adapter_for(loaded))
    assert takes_positions(loaded.model)
    assert takes_residuals(loaded.model) == (model_type == "qwen3_vl")
    assert foreign_state(loaded.model) == []
    prompt = image_prompt(vision, ["look: ", picture(1), " what is it?"])
    generate_a_little(loaded, generation(prompt, max_tokens=3))
    assert foreign_state(loaded.model) == []


def test_the_check_sees_what_it_forbids(tiny_model_path) -> None:
    """The walk finds an attribute of ours and a method copied with other globals."""
    from mlx_lm.models import llama

    loaded = load_model(str(tiny_model_path("llama")))
    attention = loaded.model.model.layers[0].self_attn
    call = llama.Attention.__call__
    copied = types.FunctionType(call.__code__, {**call.__globals__}, call.__name__,
                                call.__defaults__, call.__closure__)
    original = type(attention)
    object.__setattr__(attention, "_rewind_marker", True)
    attention.__class__ = type("Copied", (original,), {"__call__": copied})
    try:
        found = foreign_state(loaded.model)
    finally:
        attention.__class__ = original
        del attention.__dict__["_rewind_marker"]
    assert any("_rewind_marker" in line for line in found)
    assert any("copied globals" in line for line in found)
    assert foreign_state(loaded.model) == []
