"""The gated delta rule in Rewind's C kernel gives what mlx-lm's ops give: outputs and state,
for scalar and per-key gates, grouped heads, padding masks and head sizes the vectors do not
divide; and a Qwen 3.5 model loaded by Rewind computes the same logits with it as without."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from gated_delta_inputs import inputs
from mlx_lm.models.gated_delta import gated_delta_ops

from rewind.kernels import cpu_gated_delta, gated_delta, native
from rewind.kernels.rebind import computes_as, routes

pytestmark = [pytest.mark.cpu_only, pytest.mark.skipif(
    native.load_kernels() is None, reason="needs x86-64 AVX2 and a C compiler")]

TOLERANCE = 1e-5  # float32, only the order of summation differs


@pytest.mark.parametrize("shape", [
    (1, 40, 2, 2, 16, 16, False),   # the tiny model's sizes
    (2, 17, 2, 4, 128, 128, False),  # two value heads per key head
    (1, 9, 4, 4, 64, 32, True),     # per-key gates, Dv != Dk
    (3, 5, 1, 3, 20, 12, False),    # head sizes no vector width divides
    (2, 1, 2, 4, 32, 32, True),     # a decode step
])
def test_recurrence_equals_mlx_lm_ops(shape: tuple) -> None:
    batch, steps, key_heads, value_heads, key_dim, value_dim, per_key = shape
    args = inputs(batch, steps, key_heads, value_heads, key_dim, value_dim, per_key, seed=steps)
    expected_y, expected_state = gated_delta_ops(**args)
    got_y, got_state = cpu_gated_delta.recurrence(**args)
    assert got_y.shape == expected_y.shape and got_y.dtype == expected_y.dtype
    assert got_state.shape == expected_state.shape and got_state.dtype == mx.float32
    assert float(mx.abs(got_y - expected_y).max()) < TOLERANCE * max(
        1.0, float(mx.abs(expected_y).max()))
    assert float(mx.abs(got_state - expected_state).max()) < TOLERANCE * max(
        1.0, float(mx.abs(expected_state).max()))
    # The kernel wrote copies: the caller's state is unchanged.
    assert mx.array_equal(args["state"], inputs(*shape[:-1], per_key, seed=steps)["state"])


def test_a_masked_step_leaves_the_state_alone() -> None:
    """Padding positions (mask False) in a batch: the state passes them unchanged, as the ops
    keep it; real positions' outputs match."""
    args = inputs(2, 12, 2, 2, 32, 32, False, seed=5)
    mask = mx.array(np.array([[True] * 12, [False] * 4 + [True] * 8]))
    expected_y, expected_state = gated_delta_ops(**args, mask=mask)
    got_y, got_state = cpu_gated_delta.recurrence(**args, mask=mask)
    assert float(mx.abs(got_state - expected_state).max()) < 1e-4
    assert np.abs(np.array(got_y - expected_y)[np.array(mask)]).max() < 1e-4
    unmasked_row = cpu_gated_delta.recurrence(**{name: value[1:, 4:] if name != "state"
                                                 else value[1:] for name, value in args.items()})
    assert float(mx.abs(unmasked_row[1] - got_state[1:]).max()) < 1e-4


def test_a_qwen3_5_model_gives_the_same_logits_with_the_kernel(tiny_loaded,
                                                              monkeypatch: pytest.MonkeyPatch):
    """The loader points the model's linear attention at the kernel; prefill in chunks and
    decode steps give mlx-lm's logits (REWIND_GATED_DELTA=off) within float32 noise."""
    model = tiny_loaded("qwen3_5").model
    from mlx_lm.models import gated_delta as mlx_gated_delta
    from mlx_lm.models import qwen3_5

    # mlx-lm's name still leads to mlx-lm's function (rewind.kernels.rebind dispatches per
    # call); this model's linear-attention modules are routed to the kernel.
    assert qwen3_5.gated_delta_update.__wrapped__ is mlx_gated_delta.gated_delta_update
    swapped = [m for m in model.modules() if computes_as(type(m)) is qwen3_5.GatedDeltaNet]
    assert swapped and all(
        routes(m)["gated_delta_update"] is gated_delta.gated_delta_update for m in swapped)
    prompt = np.random.default_rng(3).integers(3, 400, 300).tolist()

    def logits_trace() -> np.ndarray:
        cache = make_prompt_cache(model)
        rows = []
        for start, end in ((0, 100), (100, 257), (257, 300)):
            rows.append(np.array(model(mx.array([prompt[start:end]]), cache=cache)[0]))
        for token in (5, 17, 99):
            rows.append(np.array(model(mx.array([[token]]), cache=cache)[0]))
        return np.concatenate(rows)

    with_kernel = logits_trace()
    monkeypatch.setenv(gated_delta.ENV, "off")
    without = logits_trace()
    assert np.abs(with_kernel - without).max() < 1e-4 * max(1.0, np.abs(without).max())
