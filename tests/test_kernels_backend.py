"""The kernel backend's seam: what it sets up for a model lives in its own tables, dies with the
model, and never changes mlx-lm for anyone else in the process."""

from __future__ import annotations

import gc
import weakref

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.kernels.backend import kernels_for, select
from rewind.models.loader import load_model


def test_a_model_is_freed_once_its_engine_and_loader_are_gone(tiny_model_path) -> None:
    loaded = load_model(str(tiny_model_path("llama")))
    assert select().name != "cpu" or kernels_for(loaded.model).forward is not None
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        engine.generate(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=3)), 60)
    model, layers = weakref.ref(loaded.model), weakref.ref(loaded.model.model)
    del engine, loaded
    gc.collect()
    # No table of the backend keeps an unloaded model's weights alive.
    assert model() is None and layers() is None


def test_mlx_lm_is_untouched_by_a_loaded_model(tiny_model_path) -> None:
    from mlx_lm.models import base, gated_delta, llama, qwen3_5

    load_model(str(tiny_model_path("qwen3_5")))  # MLX layers with Rewind's kernels inside
    assert qwen3_5.gated_delta_update is gated_delta.gated_delta_update
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert qwen3_5.GatedDeltaNet.__call__.__globals__["gated_delta_update"] is (
        gated_delta.gated_delta_update)
