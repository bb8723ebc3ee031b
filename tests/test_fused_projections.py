"""Sibling projections as one product (rewind.models.fused_projections): the same logits and
greedy tokens as the separate layers on every tiny family, through prefill, decode and a
compiled decode step, float and quantized; nothing held past a layer's call."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as load_mlx_model

from rewind.models import fused_projections
from rewind.testing.tiny_models import FAMILIES

PROMPT = [5, 17, 33, 2, 41, 9, 12, 60, 7, 3]


def _logits_and_tokens(model, steps: int = 4, forced: list[int] | None = None):
    """Prefill PROMPT, then `steps` greedy decode steps (or the `forced` tokens): the last
    logits of each call and the greedy tokens."""
    cache = make_prompt_cache(model)
    out = model(mx.array([PROMPT]), cache=cache)[:, -1]
    logits, tokens = [np.array(out.astype(mx.float32))], []
    for step in range(steps):
        token = int(mx.argmax(out, axis=-1).item())
        if forced is not None:
            token = forced[step]
        tokens.append(token)
        out = model(mx.array([[token]]), cache=cache)[:, -1]
        logits.append(np.array(out.astype(mx.float32)))
    return logits, tokens


def _parameter_sizes(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_give_the_separate_layers_answers(family, tiny_model_path) -> None:
    model, _ = load_mlx_model(tiny_model_path(family))
    expected_logits, expected_tokens = _logits_and_tokens(model)
    sizes = _parameter_sizes(model)
    layers = len(model.layers)

    fused = fused_projections.use_in_model(model)

    # every layer's MLP, and its attention where it has one (Qwen 3.5's linear-attention layers
    # project otherwise)
    assert fused >= layers + 1 and fused_projections.fused_in(model)
    assert _parameter_sizes(model) == sizes  # the weights held once, not twice
    logits, tokens = _logits_and_tokens(model, forced=expected_tokens)
    # on a GPU one product may round otherwise (TF32, another tiling): a near tie could move
    tol = 2e-2 if mx.default_device() == mx.gpu else 1e-4
    if mx.default_device() == mx.cpu:
        assert _logits_and_tokens(model)[1] == expected_tokens
    for got, want in zip(logits, expected_logits):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # and under mx.compile (a trace hands the parts a tracer: one product per layer still)
    whole = mx.array([PROMPT + expected_tokens])
    traced = mx.compile(lambda tokens: model(tokens))(whole)
    np.testing.assert_allclose(np.array(traced[0, len(PROMPT) - 1:].astype(mx.float32)),
                               np.concatenate(expected_logits), rtol=tol, atol=tol)


def test_quantized_projections_fuse_to_the_same_answers(tiny_model_path) -> None:
    model, _ = load_mlx_model(tiny_model_path("llama"))
    on_gpu = mx.default_device() == mx.gpu
    if on_gpu:  # MLX's CUDA quantized_matmul has no float32 kernel for these shapes
        model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=32, bits=4)
    expected_logits, expected_tokens = _logits_and_tokens(model)
    assert fused_projections.use_in_model(model) > 0
    layer = model.layers[0]
    assert type(getattr(layer.self_attn, "q_proj_k_proj_v_proj")) is nn.QuantizedLinear
    logits, tokens = _logits_and_tokens(model)
    if on_gpu:  # bf16: a product's rounding may move a near tie
        np.testing.assert_allclose(logits[0], expected_logits[0], rtol=5e-2, atol=5e-2)
        return
    assert tokens == expected_tokens
    np.testing.assert_allclose(logits[-1], expected_logits[-1], rtol=1e-4, atol=1e-4)


def test_layers_that_differ_keep_their_own() -> None:
    module = nn.Module()
    module.q_proj, module.k_proj = nn.Linear(8, 8), nn.Linear(8, 4)
    module.v_proj = nn.Linear(8, 4, bias=False)  # one without a bias: not stackable
    module.gate_proj, module.up_proj = nn.Linear(8, 16), nn.Linear(6, 16)  # other input widths
    assert fused_projections.use_in_model(module) == 0
    assert type(module.q_proj) is nn.Linear and type(module.gate_proj) is nn.Linear


def test_a_layer_sharing_another_layers_keys_keeps_its_projections() -> None:
    """Gemma 3n's KV-shared attention calls only q_proj: fused, k and v would be computed for
    nothing and their product held."""
    module = nn.Module()
    module.q_proj, module.k_proj, module.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    module.is_kv_shared_layer = True
    assert fused_projections.use_in_model(module) == 0
    module.is_kv_shared_layer = False
    assert fused_projections.use_in_model(module) == 1


def test_a_part_holds_nothing_once_every_part_took_its_slice() -> None:
    module = nn.Module()
    module.gate_proj, module.up_proj = nn.Linear(8, 16), nn.Linear(8, 12)
    gate, up = module.gate_proj, module.up_proj
    assert fused_projections.use_in_model(module) == 1
    x, y = mx.random.normal((3, 8)), mx.random.normal((3, 8))
    shared = module.gate_proj._shared
    assert np.allclose(np.array(module.gate_proj(x)), np.array(gate(x)), atol=1e-5)
    assert shared._output is not None  # up's slice still to come
    # another input first: that input's own product, the right answer
    assert np.allclose(np.array(module.up_proj(y)), np.array(up(y)), atol=1e-5)
    assert np.allclose(np.array(module.gate_proj(y)), np.array(gate(y)), atol=1e-5)
    assert shared._input is None and shared._output is None
    assert module.up_proj.output_dims == 12 and module.up_proj.input_dims == 8


def test_auto_is_off_on_the_cpu(monkeypatch) -> None:
    monkeypatch.delenv("REWIND_FUSED_PROJECTIONS", raising=False)
    assert fused_projections.wanted() is (mx.default_device() == mx.gpu and mx.cuda.is_available())
    monkeypatch.setenv("REWIND_FUSED_PROJECTIONS", "on")
    assert fused_projections.wanted()
    monkeypatch.setenv("REWIND_FUSED_PROJECTIONS", "off")
    assert not fused_projections.wanted()


@pytest.mark.skipif(not (mx.default_device() == mx.gpu and mx.cuda.is_available()),
                    reason="needs MLX's CUDA backend")
def test_the_loader_fuses_on_cuda_and_says_so_in_the_fingerprint(tiny_model_path, monkeypatch):
    from rewind.models.loader import load_model

    monkeypatch.delenv("REWIND_FUSED_PROJECTIONS", raising=False)
    fused = load_model(str(tiny_model_path("llama")))
    monkeypatch.setenv("REWIND_FUSED_PROJECTIONS", "off")
    separate = load_model(str(tiny_model_path("llama")))
    assert fused_projections.fused_in(fused.model) and not fused_projections.fused_in(separate.model)
    assert fused.fingerprint == separate.fingerprint + "|fused"
    tokens = mx.array([PROMPT])
    np.testing.assert_allclose(np.array(fused.model(tokens).astype(mx.float32)),
                               np.array(separate.model(tokens).astype(mx.float32)),
                               rtol=2e-2, atol=2e-2)

