"""The gated delta rule in Rewind's CUDA kernel gives what mlx-lm's ops give (outputs and state,
scalar and per-key gates, grouped heads, padding masks), and a Qwen 3.5 model loaded by Rewind
computes the same logits with it as without. Runs only where MLX has the CUDA backend."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from gated_delta_inputs import inputs
from mlx_lm.models.gated_delta import gated_delta_ops

from rewind.kernels import cuda_gated_delta, gated_delta
from rewind.kernels.rebind import computes_as, routes

pytestmark = pytest.mark.skipif(not mx.cuda.is_available() or mx.default_device() != mx.gpu,
                                reason="needs MLX's CUDA backend")


@pytest.mark.parametrize("shape", [(1, 40, 2, 2, 32, 32, False), (2, 17, 2, 4, 128, 128, False),
                                   (1, 9, 4, 4, 64, 48, True), (2, 1, 2, 4, 128, 128, True)])
def test_recurrence_equals_mlx_lm_ops(shape: tuple) -> None:
    args = inputs(*shape, seed=shape[1])
    expected_y, expected_state = gated_delta_ops(**args)
    got_y, got_state = cuda_gated_delta.recurrence(**args)
    assert got_y.shape == expected_y.shape and got_state.dtype == mx.float32
    assert float(mx.abs(got_y - expected_y).max()) < 1e-4 * max(1.0, float(mx.abs(expected_y).max()))
    assert float(mx.abs(got_state - expected_state).max()) < 1e-4 * max(
        1.0, float(mx.abs(expected_state).max()))


def test_a_masked_step_leaves_the_state_alone() -> None:
    args = inputs(2, 12, 2, 2, 32, 32, False, seed=5)
    mask = mx.array(np.array([[True] * 12, [False] * 4 + [True] * 8]))
    expected_y, expected_state = gated_delta_ops(**args, mask=mask)
    got_y, got_state = cuda_gated_delta.recurrence(**args, mask=mask)
    assert float(mx.abs(got_state - expected_state).max()) < 1e-4
    assert np.abs(np.array(got_y - expected_y)[np.array(mask)]).max() < 1e-4


def test_a_qwen3_5_model_gives_the_same_logits_with_the_kernel(tiny_model_path, monkeypatch):
    from mlx_lm.models import qwen3_5

    from rewind.models.loader import load_model

    # The tiny family's 16-wide key heads are below the kernel's 32: widen them.
    from rewind.testing.tiny_models import build_tiny_model

    folder = build_tiny_model("qwen3_5", tiny_model_path("qwen3_5").parent / "qwen3_5-k32",
                              overrides={"linear_key_head_dim": 32, "linear_value_head_dim": 32})
    model = load_model(str(folder)).model
    # This model's linear-attention modules are routed to the kernel (rewind.kernels.rebind).
    assert any(routes(m).get("gated_delta_update") is gated_delta.gated_delta_update
               and computes_as(type(m)) is qwen3_5.GatedDeltaNet for m in model.modules())
    prompt = np.random.default_rng(3).integers(3, 400, 300).tolist()

    def logits_trace() -> np.ndarray:
        cache = make_prompt_cache(model)
        rows = [np.array(model(mx.array([prompt[a:b]]), cache=cache)[0].astype(mx.float32))
                for a, b in ((0, 100), (100, 257), (257, 300))]
        rows += [np.array(model(mx.array([[t]]), cache=cache)[0].astype(mx.float32))
                 for t in (5, 17, 99)]
        return np.concatenate(rows)

    with_kernel = logits_trace()
    monkeypatch.setenv(gated_delta.ENV, "off")
    without = logits_trace()
    assert np.abs(with_kernel - without).max() < 1e-3 * max(1.0, np.abs(without).max())
