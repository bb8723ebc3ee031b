"""A linear-attention layer gives drafted tokens back (rewind.cache.linear_steps): after a
recorded call of an input and four drafted tokens, giving back the rejected ones leaves every
layer's cache (the gated-delta state, its convolution's state, the full-attention keys) as a call
of the kept tokens alone leaves it, bit for bit, and the next call's logits are the same."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from rewind.cache import linear_steps
from rewind.cache.kv import make_cache
from rewind.cache.rollback import roll_back, rolls_back
from rewind.kernels import gated_delta

# Speculation drafts only where each position computes alone (the CPU, rewind.kernels
# .native_linear.rows_compute_alone); on CUDA the re-run recurrence and the kept tokens' own call
# differ in the last bits (measured on an H100), and nothing gives tokens back there.
pytestmark = pytest.mark.cpu_only

PROMPT = list(range(20, 120))
FED = [7, 9, 11, 13, 15]  # the row's input and four drafted tokens


def prefilled(model):
    cache = make_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    return cache


def layer_arrays(cache) -> list[np.ndarray]:
    out = []
    for layer in cache:
        if isinstance(layer, ArraysCache):
            out += [np.array(layer[0].astype(mx.float32)), np.array(layer[1])]
        else:
            out += [np.array(layer.keys[..., :layer.offset, :].astype(mx.float32)),
                    np.array(layer.values[..., :layer.offset, :].astype(mx.float32)),
                    np.array([layer.offset])]
    return out


@pytest.fixture(scope="module")
def qwen(bf16_loaded):
    model = bf16_loaded("qwen3_5").model
    gated_delta.observe(linear_steps.note_recurrence)
    assert linear_steps.install(model)
    return model


@pytest.mark.parametrize("kept", [1, 2, 4, 5])
def test_giving_back_leaves_what_the_kept_tokens_alone_leave(qwen, kept):
    drafted = prefilled(qwen)
    assert rolls_back(drafted, linear=True) and not rolls_back(drafted)
    with linear_steps.recording(drafted):
        mx.eval(qwen(mx.array([FED]), cache=drafted))
    roll_back(drafted, len(FED) - kept)
    alone = prefilled(qwen)
    mx.eval(qwen(mx.array([FED[:kept]]), cache=alone))
    for mine, theirs in zip(layer_arrays(drafted), layer_arrays(alone), strict=True):
        assert mine.shape == theirs.shape and np.array_equal(mine, theirs)
    after_drafts = qwen(mx.array([[42]]), cache=drafted)
    after_alone = qwen(mx.array([[42]]), cache=alone)
    assert np.array_equal(np.array(after_drafts), np.array(after_alone))


def test_a_call_not_recorded_gives_nothing_back_and_changes_nothing(qwen):
    cache = prefilled(qwen)
    mx.eval(qwen(mx.array([FED]), cache=cache))  # not recorded
    before = layer_arrays(cache)
    with pytest.raises(ValueError, match="not recorded"):
        roll_back(cache, 2)
    for mine, theirs in zip(layer_arrays(cache), before, strict=True):
        assert np.array_equal(mine, theirs)


def test_a_call_kept_whole_forgets_its_record(qwen):
    cache = prefilled(qwen)
    with linear_steps.recording(cache):
        mx.eval(qwen(mx.array([FED]), cache=cache))
    assert all(linear_steps.can_give_back(layer) for layer in cache
               if isinstance(layer, ArraysCache))
    roll_back(cache, 0)
    assert not any(linear_steps.can_give_back(layer) for layer in cache
                   if isinstance(layer, ArraysCache))


def test_a_model_whose_recurrence_is_not_observed_does_not_draft(bf16_loaded):
    """install's self-check: with no observer the recurrence's arguments never reach the record,
    so the model must not draft (its first rollback would fail)."""
    model = bf16_loaded("qwen3_5").model
    gated_delta.observe(None)
    try:
        assert not linear_steps.install(model)
    finally:
        gated_delta.observe(linear_steps.note_recurrence)
    assert linear_steps.install(model)


def test_a_model_without_gated_delta_layers_does_not_record(tiny_loaded):
    assert not linear_steps.install(tiny_loaded("llama").model)
