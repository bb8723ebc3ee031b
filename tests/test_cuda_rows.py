"""rewind.kernels.cuda_rows and decode attention over several positions: a drafted row's check
on CUDA with each position's bits those of a one-token step. Which layers it takes is decided
on every backend; the kernels run where CUDA is (skipped elsewhere)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from rewind.cache.kv import GrowingKVCache, make_cache
from rewind.kernels import cuda_attention, cuda_rows
from rewind.kernels.model_split import split_model

cuda = pytest.mark.skipif(not cuda_rows.available(), reason="needs MLX's CUDA backend")


def test_linears_become_rows_linears_that_compute_as_before_outside_the_context() -> None:
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 16),
                          nn.Linear(16, 8, bias=False))
    model.set_dtype(mx.bfloat16)
    x = mx.random.normal((3, 64)).astype(mx.bfloat16)
    before = model(x)
    assert cuda_rows.use_in_model(model) == 2  # the biased one stays nn.Linear
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [cuda_rows.RowsLinear, nn.Linear, cuda_rows.RowsLinear]
    assert mx.array_equal(model(x), before).item()
    assert not cuda_rows.rows_alone_on()
    with cuda_rows.rows_alone():
        assert cuda_rows.rows_alone_on()
    assert not cuda_rows.rows_alone_on()


def test_float32_linears_and_models_off_cuda_are_not_taken() -> None:
    layer = nn.Linear(8, 8, bias=False)  # float32
    assert not cuda_rows.takes_linear(layer)
    if not cuda_rows.available():
        assert not cuda_rows.layers_compute_rows_alone(nn.Sequential(layer),
                                                        cuda_attention.kernel_takes_heads)


def test_bad_products_raise() -> None:
    weight = mx.zeros((16, 64), mx.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        cuda_rows.matmul(mx.zeros((2, 32), mx.bfloat16), weight)
    with pytest.raises(ValueError, match="one dtype"):
        cuda_rows.matmul(mx.zeros((2, 64), mx.float32), weight)
    with pytest.raises(ValueError, match="rows"):
        cuda_rows.matmul(mx.zeros((cuda_rows.MAX_ROWS + 1, 64), mx.bfloat16), weight)


@cuda
@pytest.mark.parametrize("k, n", [(256, 96), (2048, 512), (960, 300), (800, 72), (100, 10)])
def test_each_row_has_the_bits_of_mlxs_one_row_product(k: int, n: int) -> None:
    weight = (mx.random.normal((n, k)) * 0.05).astype(mx.bfloat16)
    for rows in (1, 3, 8, 9, 17):
        x = mx.random.normal((1, rows, k)).astype(mx.bfloat16)
        ours = cuda_rows.matmul(x, weight)
        assert ours.shape == (1, rows, n)
        for p in range(rows):
            one = x[:, p:p + 1, :] @ weight.T
            assert mx.array_equal(ours[:, p:p + 1, :], one).item(), (k, n, rows, p)


@cuda
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (8, 2, 256), (6, 6, 128)])
def test_attention_positions_have_the_bits_of_one_token_calls(heads, kv_heads, dim) -> None:
    capacity = 2600
    keys = mx.random.normal((1, kv_heads, capacity, dim)).astype(mx.bfloat16)
    values = mx.random.normal((1, kv_heads, capacity, dim)).astype(mx.bfloat16)
    starts = mx.zeros((1,), mx.int32)
    # one span; several (cuda_attention.KEYS_PER_SPAN, MAX_SPANS)
    for length in (20, 1030, 2500):
        for positions in (2, 9, 17):
            queries = mx.random.normal((1, heads, positions, dim)).astype(mx.bfloat16)
            ours = cuda_attention.decode_attention(queries, keys, values, length, starts, 0.1)
            for p in range(positions):
                one = cuda_attention.decode_attention(
                    queries[:, :, p:p + 1, :], keys, values, length - (positions - 1 - p),
                    starts, 0.1)
                assert mx.array_equal(ours[:, :, p:p + 1, :], one).item(), (length, positions, p)
            # as a compiled step calls it: the length on the device, spans over the buffer
            last = cuda_attention.decode_attention(queries[:, :, -1:, :], keys, values,
                                                   mx.array([length], mx.int32), starts, 0.1)
            assert mx.array_equal(ours[:, :, -1:, :], last).item()


@cuda
def test_a_models_positions_in_one_call_are_its_one_token_steps(tiny_model_path) -> None:
    """A bf16 Llama as the loader prepares it on CUDA: tokens fed one step at a time and the
    same tokens in one call inside rows_alone give the same hidden states and logits, bit for
    bit."""
    from rewind.models.loader import load_model

    loaded = load_model(str(tiny_model_path("llama")), dtype=mx.bfloat16)
    model = loaded.model
    assert cuda_rows.layers_compute_rows_alone(model, cuda_attention.kernel_takes_heads)
    assert all(type(layer) is GrowingKVCache for layer in make_cache(model))
    split = split_model(model)
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(10, 400, 90)]
    base, tail = prompt[:73], prompt[73:]

    def prefilled():
        cache = make_cache(model)
        mx.eval(split.backbone(mx.array([base]), cache=cache))
        return cache

    cache = prefilled()
    steps = mx.concatenate([split.backbone(mx.array([[t]]), cache=cache) for t in tail], axis=1)
    cache = prefilled()
    with cuda_rows.rows_alone():
        together = split.backbone(mx.array([tail]), cache=cache)
    assert mx.array_equal(steps, together).item()
    head = cuda_rows.head_of(split.head)
    assert head is not None
    logits = split.logits(together, head)
    for p in range(len(tail)):
        assert mx.array_equal(logits[:, p, :], split.logits(steps[:, p, :])).item()
