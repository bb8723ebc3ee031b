"""Linear attention's depthwise convolution as shifted multiply-adds (rewind.kernels.shifted_conv,
used on CUDA): the same outputs as nn.Conv1d, in a layer and in a whole hybrid model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from rewind.kernels import shifted_conv


def conv_pair(channels: int, kernel: int, bias: bool) -> tuple[nn.Conv1d, nn.Conv1d]:
    reference = nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)
    if bias:
        reference.bias = mx.random.normal(reference.bias.shape)
    shifted = nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)
    shifted.update(reference.parameters())
    assert shifted_conv.use_in_model(shifted) == 1
    return reference, shifted


@pytest.mark.parametrize("rows", [5, 37, 260])
@pytest.mark.parametrize("bias", [False, True])
def test_same_outputs_as_conv1d(rows: int, bias: bool) -> None:
    mx.random.seed(rows)
    reference, shifted = conv_pair(24, 4, bias)
    x = mx.random.normal((2, rows, 24))
    np.testing.assert_allclose(np.array(shifted(x)), np.array(reference(x)), rtol=1e-5, atol=1e-5)


def test_a_decode_step_is_conv1d_itself() -> None:
    reference, shifted = conv_pair(16, 4, False)
    x = mx.random.normal((3, 4, 16))  # 3 kept inputs and the new one: one output row
    assert mx.array_equal(shifted(x), reference(x))


def test_only_plain_depthwise_convolutions_are_taken() -> None:
    assert shifted_conv.takes(nn.Conv1d(8, 8, 4, groups=8))
    assert not shifted_conv.takes(nn.Conv1d(8, 8, 4))  # dense
    assert not shifted_conv.takes(nn.Conv1d(8, 8, 4, groups=8, padding=1))
    assert not shifted_conv.takes(nn.Conv1d(8, 8, 4, groups=8, stride=2))
    assert not shifted_conv.takes(nn.Linear(8, 8))


def test_a_hybrid_model_answers_the_same(tiny_model_path) -> None:
    from mlx_lm.utils import load as mlx_lm_load

    model, _ = mlx_lm_load(str(tiny_model_path("qwen3_5")))
    prompt = mx.array([[5, 17, 99, 23, 42, 8, 77, 31, 64, 12, 90, 3]])
    reference = model(prompt)
    changed = shifted_conv.use_in_model(model)
    assert changed > 0
    assert changed == sum(1 for layer in model.layers if hasattr(layer, "linear_attn"))
    np.testing.assert_allclose(np.array(model(prompt)), np.array(reference), rtol=1e-4, atol=1e-4)
