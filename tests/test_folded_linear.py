"""A linear layer's batch folded into one matrix product (rewind.kernels.folded_linear, used on
GPUs): the same outputs as nn.Linear for every input shape, in a layer and in a whole model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from rewind.kernels import folded_linear


def linear_pair(bias: bool) -> tuple[nn.Linear, nn.Linear]:
    reference = nn.Linear(64, 48, bias=bias)
    folded = nn.Linear(64, 48, bias=bias)
    folded.update(reference.parameters())
    assert folded_linear.use_in_model(folded) == 1
    return reference, folded


@pytest.mark.parametrize("shape", [(5, 1, 64), (3, 7, 64), (1, 9, 64), (1, 1, 64), (6, 64),
                                   (2, 3, 4, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_same_outputs_as_linear(shape: tuple[int, ...], bias: bool) -> None:
    mx.random.seed(len(shape) * 10 + shape[0])
    reference, folded = linear_pair(bias)
    x = mx.random.normal(shape)
    out = folded(x)
    assert out.shape == reference(x).shape
    np.testing.assert_allclose(np.array(out), np.array(reference(x)), rtol=1e-5, atol=1e-5)


def test_a_strided_batch_folds_its_own_rows() -> None:
    """Rows taken out of a wider array (a slice: not contiguous) stay each row's own."""
    reference, folded = linear_pair(True)
    wide = mx.random.normal((4, 3, 64))
    x = wide[:, 1:2, :]
    np.testing.assert_allclose(np.array(folded(x)), np.array(reference(x)), rtol=1e-5, atol=1e-5)


def test_quantized_layers_keep_their_class() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.QuantizedLinear(64, 64))
    assert folded_linear.use_in_model(model) == 1
    assert type(model.layers[1]) is nn.QuantizedLinear


def test_a_model_decoding_three_rows_answers_the_same(tiny_model_path) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load as mlx_lm_load

    model, _ = mlx_lm_load(str(tiny_model_path("llama")))
    prompt = mx.array([[5, 17, 99, 23], [42, 8, 77, 31], [64, 12, 90, 3]])
    step = mx.array([[7], [11], [13]])

    def two_calls() -> mx.array:
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)
        return model(step, cache=cache)  # the decode call: [3, 1, H] activations

    reference = two_calls()
    changed = folded_linear.use_in_model(model)
    assert changed >= 7 * len(model.layers)  # q, k, v, o, gate, up, down
    np.testing.assert_allclose(np.array(two_calls()), np.array(reference), rtol=1e-4, atol=1e-4)
