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


def test_a_plain_mlx_lm_model_beside_a_loaded_one_runs_mlx_lms_functions(tiny_model_path) -> None:
    """Rewind routes its own model's attention and gated delta rule to its kernels
    (rewind.kernels.rebind); an mlx-lm model in the same process still calls mlx-lm's functions
    and never Rewind's, and mlx-lm's classes are as shipped."""
    import sys

    import mlx.core as mx
    from mlx_lm.models import base, gated_delta, qwen3_5, qwen3_next
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as load_mlx_model

    from rewind.kernels import cpu_attention, cuda_attention
    from rewind.kernels import gated_delta as rewind_gated_delta

    path = tiny_model_path("qwen3_5")
    ours = load_model(str(path)).model  # MLX layers with Rewind's kernels inside
    plain, _ = load_mlx_model(path)
    # The names in mlx-lm's module lead to mlx-lm's own functions; its classes' code and globals
    # are its own.
    assert qwen3_5.gated_delta_update.__wrapped__ is gated_delta.gated_delta_update
    assert qwen3_next.scaled_dot_product_attention.__wrapped__ is (
        base.scaled_dot_product_attention)
    assert qwen3_5.GatedDeltaNet.__call__.__globals__ is vars(qwen3_5)
    assert all(type(m).__module__.startswith(("mlx.", "mlx_lm.")) for m in plain.modules())

    # attention: the CPU's C kernel, or on CUDA the decode kernel's router (Metal keeps MLX's)
    attention = (cuda_attention._attention if mx.cuda.is_available()
                 else cpu_attention._mlx_layers_attention)
    kernels = {rewind_gated_delta.gated_delta_update.__code__, attention.__code__}
    mlx_lms = {gated_delta.gated_delta_update.__code__, base.scaled_dot_product_attention.__code__}

    def called(model) -> set:
        seen = set()

        def profile(frame, event, arg):
            if event == "call":
                seen.add(frame.f_code)

        tokens = mx.array([[5, 6, 7, 8, 9]])
        sys.setprofile(profile)
        try:
            mx.eval(model(tokens, cache=make_prompt_cache(model)))
        finally:
            sys.setprofile(None)
        return seen

    ours_called, plain_called = called(ours), called(plain)
    assert kernels <= ours_called
    assert mlx_lms <= plain_called and not kernels & plain_called
