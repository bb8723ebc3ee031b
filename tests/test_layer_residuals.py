"""The engine's layer-residual seam (rewind.engine.residuals) on a plain tiny llama running MLX's
layers: a residual given for a call is added to that layer's output and nothing else changes;
the layers keep their parameters; a model on the CPU kernels, or a layer that takes none, is
refused instead of computing without them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from rewind.engine.residuals import given_residuals, install_layer_residuals, takes_residuals
from rewind.models.loader import load_model, use_mlx_layers


@pytest.fixture
def model(tiny_model_path):
    loaded = load_model(str(tiny_model_path("llama")))
    use_mlx_layers(loaded.model)
    return loaded.model


def by_hand(model, tokens: mx.array, residuals: dict[int, mx.array]) -> mx.array:
    """The backbone's loop written out, adding each residual after its layer (on layers that
    take no residuals themselves)."""
    assert not takes_residuals(model)
    backbone = model.model
    cache = make_prompt_cache(model)
    hidden = backbone.embed_tokens(tokens)
    mask = create_attention_mask(hidden, cache[0])
    for index, (layer, layer_cache) in enumerate(zip(backbone.layers, cache)):
        hidden = layer(hidden, mask, layer_cache)
        if index in residuals:
            hidden = hidden + residuals[index]
    return model.lm_head(backbone.norm(hidden))


def test_a_residual_is_added_after_its_layer(model):
    tokens = mx.array([[5, 17, 33, 40, 41, 42, 80, 90]])
    plain = model(tokens, cache=make_prompt_cache(model))
    rng = np.random.default_rng(0)
    residuals = {layer: mx.array(rng.normal(size=(1, 8, 64)).astype(np.float32))
                 for layer in (0, 1)}
    residuals[1][:, :4] = 0  # zero rows: those positions see exactly the layer's output
    expected = by_hand(model, tokens, residuals)
    names = [name for name, _ in tree_flatten(model.parameters())]
    install_layer_residuals(model, model.model.layers[:2])
    assert [name for name, _ in tree_flatten(model.parameters())] == names
    with given_residuals(model, residuals):
        added = model(tokens, cache=make_prompt_cache(model))
    np.testing.assert_allclose(np.array(added), np.array(expected), atol=1e-5)
    assert np.abs(np.array(added) - np.array(plain)).max() > 0.1
    # Outside the context nothing is added.
    again = model(tokens, cache=make_prompt_cache(model))
    np.testing.assert_allclose(np.array(again), np.array(plain), atol=1e-6)


def test_a_layer_that_takes_none_is_refused(model):
    install_layer_residuals(model, model.model.layers[:2])
    with pytest.raises(ValueError, match=r"layer\(s\) \[3\]"):
        with given_residuals(model, {3: mx.zeros((1, 1, 64))}):
            pass


def test_the_cpu_kernels_are_refused(tiny_model_path):
    from rewind.kernels.native_forward import native_forward

    loaded = load_model(str(tiny_model_path("llama")))
    if native_forward(loaded.model) is None:
        pytest.skip("the CPU kernels are not installed on this machine")
    with pytest.raises(ValueError, match="CPU kernels"):
        install_layer_residuals(loaded.model, loaded.model.model.layers[:1])
