"""rewind.kernels.cuda_attention: a decode batch of left-padded rows without MLX's masked
attention on CUDA. Which calls it takes is decided from the cache (runs on every backend); the
kernel itself runs where CUDA is (skipped elsewhere): it gives MLX's masked answer, and a row's
bits do not depend on its padding or its neighbours."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from rewind.cache.kv import GrowingBatchKVCache, GrowingKVCache
from rewind.kernels import cuda_attention

cuda = pytest.mark.skipif(not cuda_attention.available(), reason="needs MLX's CUDA backend")


def filled(length: int, heads: int = 2, dim: int = 32, seed: int = 0) -> GrowingKVCache:
    cache = GrowingKVCache()
    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((1, heads, length, dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, heads, length, dim)).astype(np.float32))
    cache.update_and_fetch(keys, values)
    return cache


def decode_step(batch: GrowingBatchKVCache, heads: int = 2, dim: int = 32, **mask_kwargs):
    mask = batch.make_mask(1, **mask_kwargs)
    new = mx.zeros((batch.keys.shape[0], heads, 1, dim))
    keys, values = batch.update_and_fetch(new, new)
    return mask, keys, values


def test_a_padded_decode_step_is_taken_with_each_rows_first_slot() -> None:
    batch = GrowingBatchKVCache.merge([filled(5), filled(9, seed=1), filled(2, seed=2)])
    mask, keys, _ = decode_step(batch)
    layout = cuda_attention._padded_layout(batch, keys, mask)
    assert layout is not None
    length, starts = layout
    assert length == 10 and starts.tolist() == [4, 0, 7]
    # what the mask says, row by row: keys from the row's first slot on
    allowed = np.array(mask).reshape(3, -1)
    assert [int(np.argmax(row)) for row in allowed] == [4, 0, 7] and allowed.all(axis=0)[-1]


def test_other_masks_keep_mlx() -> None:
    batch = GrowingBatchKVCache.merge([filled(5), filled(9, seed=1)])
    windowed, keys, _ = decode_step(batch, window_size=4)
    assert cuda_attention._padded_layout(batch, keys, windowed) is None
    chunk_mask = batch.make_mask(3)  # a prompt chunk's mask
    assert not batch.left_padding_only(chunk_mask)
    plain, keys, _ = decode_step(batch)
    assert cuda_attention._padded_layout(batch, keys, plain) is not None
    # a copy of the mask, another layer's keys of another length, or a plain cache: not taken
    assert cuda_attention._padded_layout(batch, keys, mx.array(np.array(plain))) is None
    assert cuda_attention._padded_layout(batch, keys[..., :-1, :], plain) is None
    assert cuda_attention._padded_layout(filled(4), keys, plain) is None


def test_the_mask_is_remembered_per_thread() -> None:
    batch = GrowingBatchKVCache.merge([filled(5), filled(9, seed=1)])
    mask, _, _ = decode_step(batch)
    seen: list[bool] = []
    other = threading.Thread(target=lambda: seen.append(batch.left_padding_only(mask)))
    other.start()
    other.join()
    assert seen == [False] and batch.left_padding_only(mask)


def test_shapes_the_kernel_does_not_take_raise() -> None:
    q = mx.zeros((2, 4, 1, 64))
    kv = mx.zeros((2, 2, 16, 64))
    starts = mx.array([0, 3])
    with pytest.raises(ValueError, match="query tokens per row"):
        cuda_attention.decode_attention(mx.zeros((2, 4, 65, 64)), kv, kv, 8, starts, 0.1)
    with pytest.raises(ValueError, match="capacity"):  # 3 positions need 3 keys at least
        cuda_attention.decode_attention(mx.zeros((2, 4, 3, 64)), kv, kv, 2, starts, 0.1)
    with pytest.raises(ValueError, match="do not fit"):
        cuda_attention.decode_attention(mx.zeros((2, 3, 1, 64)), kv, kv, 8, starts, 0.1)
    with pytest.raises(ValueError, match="multiple of 32"):
        cuda_attention.decode_attention(mx.zeros((2, 4, 1, 48)), mx.zeros((2, 2, 16, 48)),
                                        mx.zeros((2, 2, 16, 48)), 8, starts, 0.1)
    with pytest.raises(ValueError, match="capacity"):
        cuda_attention.decode_attention(q, kv, kv, 17, starts, 0.1)
    with pytest.raises(ValueError, match="one element"):
        cuda_attention.decode_attention(q, kv, kv, mx.array([8, 9]), starts, 0.1)
    with pytest.raises(ValueError, match="keys_per_span"):
        cuda_attention.decode_attention(q, kv, kv, 8, starts, 0.1, keys_per_span=20)
    with pytest.raises(ValueError, match="elements_per_lane"):
        cuda_attention.decode_attention(q, kv, kv, 8, starts, 0.1, elements_per_lane=3)
    with pytest.raises(ValueError, match="unroll"):
        cuda_attention.decode_attention(q, kv, kv, 8, starts, 0.1, unroll=3)
    with pytest.raises(ValueError, match="max_spans"):  # spans are the grid's y
        cuda_attention.decode_attention(q, kv, kv, 8, starts, 0.1, max_spans=1 << 16)
    with pytest.raises(ValueError, match="warps"):
        cuda_attention.decode_attention(q, kv, kv, 8, starts, 0.1, warps=3)
    with pytest.raises(ValueError, match="shared memory"):  # 16 query heads of 256 per group
        cuda_attention.decode_attention(mx.zeros((2, 16, 1, 256)), mx.zeros((2, 1, 16, 256)),
                                        mx.zeros((2, 1, 16, 256)), 8, starts, 0.1)


def test_groups_too_wide_for_a_block_keep_mlx() -> None:
    wide = GrowingBatchKVCache.merge([filled(5, heads=1, dim=256), filled(9, heads=1, dim=256)])
    assert not cuda_attention._kernel_takes(mx.zeros((2, 16, 1, 256)), wide)
    assert cuda_attention._kernel_takes(mx.zeros((2, 4, 1, 256)), wide)


@cuda
@pytest.mark.parametrize("heads,kv_heads,dim",
                         [(32, 8, 64), (8, 2, 256), (4, 4, 128), (16, 1, 64), (8, 1, 128),
                          (24, 8, 128), (9, 3, 64), (15, 5, 64)])
def test_kernel_gives_mlxs_masked_attention(heads: int, kv_heads: int, dim: int) -> None:
    rng = np.random.default_rng(dim)
    batch, capacity, length = 5, 640, 500
    q = mx.array(rng.standard_normal((batch, heads, 1, dim)).astype(np.float32)).astype(mx.bfloat16)
    k = mx.array(rng.standard_normal((batch, kv_heads, capacity, dim)).astype(np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((batch, kv_heads, capacity, dim)).astype(np.float32)).astype(mx.bfloat16)
    scale = dim ** -0.5

    def masked(length: int, starts: mx.array) -> np.ndarray:
        mask = mx.arange(length)[None, None, None, :] >= starts[:, None, None, None]
        return np.array(mx.fast.scaled_dot_product_attention(
            q.astype(mx.float32), k[..., :length, :].astype(mx.float32),
            v[..., :length, :].astype(mx.float32), scale=scale, mask=mask))

    starts = mx.array([0, 1, 77, 499, 300], mx.int32)
    expected = masked(length, starts)
    # 500 keys: one block per (row, key-value head), spans of at least 256 (2) and a
    # combine, spans of at least 64
    for keys_per_span in (1 << 20, 256, 64):
        got = cuda_attention.decode_attention(q, k, v, length, starts, scale, keys_per_span)
        assert got.shape == q.shape and got.dtype == mx.bfloat16
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected,
                                   atol=2e-2, rtol=2e-2)
        # the length as an array on the device, as a compiled step gives it: spans for the
        # whole buffer of 640 (3 of 256, 10 of 64; the last ones empty), the same bits
        from_array = cuda_attention.decode_attention(q, k, v, mx.array([length]), starts, scale,
                                                     keys_per_span)
        assert np.array_equal(np.array(from_array.astype(mx.float32)),
                              np.array(got.astype(mx.float32)))
    # every way of sharing a key among a warp's lanes gives MLX's answer, through one block
    # and through spans alike (the default's bits are held above)
    for lanes_per_key in (32, 16, 8, 4):
        vec = dim // lanes_per_key
        if vec > 8 or (heads // kv_heads) * vec > 64:
            continue
        for keys_per_span in (1 << 20, 64):
            got = cuda_attention.decode_attention(q, k, v, length, starts, scale, keys_per_span,
                                                  elements_per_lane=vec)
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected,
                                       atol=2e-2, rtol=2e-2)
    # every number of key sets a warp's round takes (each set one more key a lane in flight)
    for unroll in (1, 2, 4):
        for keys_per_span in (1 << 20, 64):
            got = cuda_attention.decode_attention(q, k, v, length, starts, scale, keys_per_span,
                                                  unroll=unroll)
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected,
                                       atol=2e-2, rtol=2e-2)
    # a short context in that buffer: one block from an integer length, the spans and their
    # combine from the device's length, the same bits
    short_starts = mx.array([0, 1, 77, 199, 100], mx.int32)
    one_block = cuda_attention.decode_attention(q, k, v, 200, short_starts, scale, 256)
    spanned = cuda_attention.decode_attention(q, k, v, mx.array([200]), short_starts, scale, 256)
    np.testing.assert_allclose(np.array(one_block.astype(mx.float32)),
                               masked(200, short_starts), atol=2e-2, rtol=2e-2)
    assert np.array_equal(np.array(spanned.astype(mx.float32)),
                          np.array(one_block.astype(mx.float32)))


@cuda
def test_a_length_past_the_buffer_reads_only_the_buffer() -> None:
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float32)).astype(mx.bfloat16)
    k = mx.array(rng.standard_normal((2, 2, 96, 64)).astype(np.float32)).astype(mx.bfloat16)
    starts = mx.array([0, 10], mx.int32)
    for keys_per_span in (1 << 20, 32):
        whole = cuda_attention.decode_attention(q, k, k, 96, starts, 0.125, keys_per_span)
        past = cuda_attention.decode_attention(q, k, k, mx.array([10_000]), starts, 0.125,
                                               keys_per_span)
        assert np.array_equal(np.array(past.astype(mx.float32)),
                              np.array(whole.astype(mx.float32)))


def test_the_default_layout_fits_every_head_shape_the_kernel_takes() -> None:
    """D / VEC lanes must divide a warp for every head size and group (groups of 3 or 5 once
    gave VEC 5 or 3, which the kernel refused at every decode step)."""
    for dim in range(32, 257, 32):
        for group in range(1, 17):
            vec = cuda_attention._elements_per_lane(dim, group)
            assert cuda_attention._lanes_fit(dim, vec), (dim, group, vec)
            most = 16 if dim == 256 and group <= 4 else 8
            assert dim // 32 <= vec <= most or dim // 32 > most


@cuda
@pytest.mark.parametrize("dtype,vec", [(mx.bfloat16, 8), (mx.float32, 4)])
def test_buffers_off_a_16_byte_boundary_give_the_same_bits(dtype, vec) -> None:
    """Keys and values that start one element past an aligned address (a view into a larger
    array) are read an element at a time, with the same arithmetic as the 16-byte loads (VEC
    elements of this dtype are 16 bytes: the wide loop is built)."""
    rng = np.random.default_rng(3)
    shape = (2, 2, 96, 64)
    size = int(np.prod(shape))
    flat = mx.array(rng.standard_normal(size + 1).astype(np.float32)).astype(dtype)
    shifted = flat[1:].reshape(shape)
    aligned = mx.array(np.array(shifted.astype(mx.float32))).astype(dtype)
    q = mx.array(rng.standard_normal((2, 8, 1, 64)).astype(np.float32)).astype(dtype)
    starts = mx.array([0, 9], mx.int32)
    for keys_per_span in (1 << 20, 32):
        wide = cuda_attention.decode_attention(q, aligned, aligned, 96, starts, 0.125,
                                               keys_per_span, elements_per_lane=vec)
        narrow = cuda_attention.decode_attention(q, shifted, shifted, 96, starts, 0.125,
                                                 keys_per_span, elements_per_lane=vec)
        assert np.array_equal(np.array(narrow.astype(mx.float32)),
                              np.array(wide.astype(mx.float32)))


@cuda
@pytest.mark.parametrize("keys_per_span", [1 << 20, 512, 64])
def test_a_rows_bits_do_not_depend_on_its_padding_or_neighbours(keys_per_span: int) -> None:
    """Also across the one-block and the spanned kernel: alone, the row's 300 keys fit one span
    of 512; in a batch of 640 keys the spans and the combine run."""
    rng = np.random.default_rng(1)
    own_k = rng.standard_normal((1, 2, 300, 64)).astype(np.float32)
    own_v = rng.standard_normal((1, 2, 300, 64)).astype(np.float32)
    q = mx.array(rng.standard_normal((1, 8, 1, 64)).astype(np.float32)).astype(mx.bfloat16)
    alone = cuda_attention.decode_attention(
        q, mx.array(own_k).astype(mx.bfloat16), mx.array(own_v).astype(mx.bfloat16), 300,
        mx.array([0]), 0.125, keys_per_span)
    padding = 340
    k = np.zeros((3, 2, 640, 64), np.float32)
    v = np.zeros((3, 2, 640, 64), np.float32)
    k[1, :, padding:padding + 300], v[1, :, padding:padding + 300] = own_k[0], own_v[0]
    k[0], v[0] = rng.standard_normal((2, 640, 64)), rng.standard_normal((2, 640, 64))
    k[2], v[2] = rng.standard_normal((2, 640, 64)), rng.standard_normal((2, 640, 64))
    queries = mx.concatenate([q * 2, q, q * 3])
    batched = cuda_attention.decode_attention(
        queries, mx.array(k).astype(mx.bfloat16), mx.array(v).astype(mx.bfloat16),
        padding + 300, mx.array([0, padding, 50]), 0.125, keys_per_span)
    assert np.array_equal(np.array(batched[1:2].astype(mx.float32)),
                          np.array(alone.astype(mx.float32)))


@cuda
def test_a_lone_rows_keys_are_spread_over_spans_of_its_own_size() -> None:
    """One row of 1,100 keys is cut into spans by its own key count (one block per key-value
    head would leave most of the GPU idle): MLX's answer, and the same bits from an integer
    length, from the device's length in a larger buffer, and beside a row of 6,000 keys (whose
    own spans are larger, and which launches more)."""
    rng = np.random.default_rng(5)
    own = 1100
    q = mx.array(rng.standard_normal((1, 32, 1, 64)).astype(np.float32)).astype(mx.bfloat16)
    k = rng.standard_normal((1, 8, own, 64)).astype(np.float32)
    v = rng.standard_normal((1, 8, own, 64)).astype(np.float32)
    keys, values = mx.array(k).astype(mx.bfloat16), mx.array(v).astype(mx.bfloat16)
    alone = cuda_attention.decode_attention(q, keys, values, own, mx.array([0]), 0.125)
    expected = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), scale=0.125)
    np.testing.assert_allclose(np.array(alone.astype(mx.float32)), np.array(expected),
                               atol=2e-2, rtol=2e-2)
    capacity = 6000
    big_k = np.zeros((2, 8, capacity, 64), np.float32)
    big_v = np.zeros((2, 8, capacity, 64), np.float32)
    big_k[0] = rng.standard_normal((8, capacity, 64))
    big_v[0] = rng.standard_normal((8, capacity, 64))
    padding = capacity - own
    big_k[1, :, padding:], big_v[1, :, padding:] = k[0], v[0]
    batched = cuda_attention.decode_attention(
        mx.concatenate([q * 2, q]), mx.array(big_k).astype(mx.bfloat16),
        mx.array(big_v).astype(mx.bfloat16), capacity, mx.array([0, padding]), 0.125)
    on_device = cuda_attention.decode_attention(
        q, mx.array(big_k[1:, :, padding:]).astype(mx.bfloat16),
        mx.array(big_v[1:, :, padding:]).astype(mx.bfloat16), mx.array([own]), mx.array([0]),
        0.125)
    for other in (batched[1:2], on_device):
        assert np.array_equal(np.array(other.astype(mx.float32)),
                              np.array(alone.astype(mx.float32)))
    # and one span per key-value head (the kernel before spans were sized by the row) agrees
    one_block = cuda_attention.decode_attention(q, keys, values, own, mx.array([0]), 0.125,
                                                keys_per_span=1 << 20)
    np.testing.assert_allclose(np.array(one_block.astype(mx.float32)),
                               np.array(alone.astype(mx.float32)), atol=2e-2, rtol=2e-2)


@cuda
def test_a_mixed_length_batch_decodes_as_with_mlxs_attention(tiny_model_path) -> None:
    """Through the engine on a tiny Llama: three prompts of different lengths decoding together
    give the tokens and (up to bf16 rounding) the log-probabilities of MLX's masked attention,
    and the kernel really ran."""
    from rewind import env
    from rewind.models.loader import load_model
    from rewind.testing.engine_answers import greedy_answers

    loaded = load_model(str(tiny_model_path("llama")))
    prompts = [loaded.tokenizer.encode(text) for text in
               ("one two three", "a longer prompt with quite a few more words in it than the first",
                "the middle one, of some length")]
    calls = 0
    original = cuda_attention.decode_attention

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    def run() -> list[list[tuple[int, float]]]:
        return greedy_answers(loaded, prompts, timeout=120)

    cuda_attention.decode_attention = counted
    try:
        with_kernel = run()
        with env.overridden({env.CUDA_ATTENTION: "off"}):
            without = run()
    finally:
        cuda_attention.decode_attention = original
    assert calls > 0
    for ours, theirs in zip(with_kernel, without):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=0.05)


def _reference(queries, key_buffer, value_buffer, length, starts, scale):
    """What decode_attention computes, row by row through MLX: each row's keys from its start."""
    rows = [mx.fast.scaled_dot_product_attention(
        queries[b:b + 1], key_buffer[b:b + 1, :, start:length],
        value_buffer[b:b + 1, :, start:length], scale=scale)
        for b, start in enumerate(starts.tolist())]
    return mx.concatenate(rows)


def test_a_models_padded_decode_step_is_routed_with_each_rows_keys(tiny_model_path, monkeypatch):
    """On any backend, with the kernel replaced by its definition: mlx-lm's Llama decoding two
    rows of different lengths in one left-padded batch routes every layer's attention to the
    kernel with the right buffers, length and starts, and gets MLX's masked logits."""
    from mlx_lm.utils import load

    model, _ = load(str(tiny_model_path("llama")))
    plain, _ = load(str(tiny_model_path("llama")))
    assert cuda_attention.use_in_model(model) > 0
    calls: list[list[int]] = []

    def recorded(queries, key_buffer, value_buffer, length, starts, scale):
        calls.append(starts.tolist())
        return _reference(queries, key_buffer, value_buffer, length, starts, scale)

    monkeypatch.setattr(cuda_attention, "decode_attention", recorded)

    def decode(which) -> np.ndarray:
        from rewind.cache.kv import make_cache

        rows = []
        for prompt in ([5, 9, 13, 17, 21, 25, 29], [7, 11, 15]):
            cache = make_cache(which)
            mx.eval(which(mx.array([prompt]), cache=cache))
            rows.append(cache)
        batch = [GrowingBatchKVCache.merge([a, b]) for a, b in zip(*rows)]
        return np.array(which(mx.array([[40], [41]]), cache=batch).astype(mx.float32))

    routed, masked = decode(model), decode(plain)
    assert len(calls) == len(model.layers) and all(c == [0, 4] for c in calls)
    np.testing.assert_allclose(routed, masked, atol=1e-4, rtol=1e-4)


def test_keys_wider_than_values_keep_mlx(monkeypatch) -> None:
    """DeepSeek-V2-like layers (192-wide keys, 128-wide values) pass the same mask: MLX's
    attention takes them, not the kernel (which would raise)."""
    from mlx_lm.models import base

    monkeypatch.setattr(cuda_attention, "decode_attention",
                        lambda *a, **k: pytest.fail("the kernel was called"))
    rows = []
    for length in (5, 9):
        cache = GrowingKVCache()
        cache.update_and_fetch(mx.ones((1, 2, length, 64)), mx.ones((1, 2, length, 32)))
        rows.append(cache)
    batch = GrowingBatchKVCache.merge(rows)
    mask = batch.make_mask(1)
    keys, values = batch.update_and_fetch(mx.ones((2, 2, 1, 64)), mx.ones((2, 2, 1, 32)))
    queries = mx.ones((2, 4, 1, 64))
    out = cuda_attention._attention(queries, keys, values, batch, 0.125, mask)
    expected = base.scaled_dot_product_attention(queries, keys, values, batch, 0.125, mask)
    assert out.shape == (2, 4, 1, 32) and np.allclose(np.array(out), np.array(expected))


def test_warm_kernels_runs_each_variant_for_the_head_shapes_called(monkeypatch) -> None:
    """warm_kernels runs the one-block and the spanned kernel for every head shape called before
    (recorded on any backend; run only where CUDA is)."""
    monkeypatch.setattr(cuda_attention, "_SEEN", set())
    q = mx.zeros((2, 4, 1, 64), mx.bfloat16)
    kv = mx.zeros((2, 2, 16, 64), mx.bfloat16)
    if not cuda_attention.available():
        assert cuda_attention.warm_kernels() == 0
        return
    cuda_attention.decode_attention(q, kv, kv, 16, mx.array([0, 3]), 0.125)
    built: list[str] = []
    for name in ("_kernel", "_spans_kernel", "_combine_kernel"):
        original = getattr(cuda_attention, name)
        monkeypatch.setattr(cuda_attention, name,
                            lambda name=name, original=original: built.append(name) or original())
    assert cuda_attention.warm_kernels() == 1
    assert sorted(built) == ["_combine_kernel", "_kernel", "_spans_kernel"]


@pytest.mark.parametrize("queries,mask", [(180, "causal"), (1, None)])
def test_a_quantized_cache_attends_through_its_dequantized_keys(queries: int, mask) -> None:
    """`rewind generate --kv-bits`: over mlx-lm's QuantizedKVCache the routed attention gives
    mlx-lm's quantized answer (computed on the CPU, whose quantized_matmul takes every shape), without
    the packed product MLX's CUDA backend refuses for most key counts."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    heads, kv_heads, dim, length = 4, 1, 64, 180
    cache = QuantizedKVCache(group_size=64, bits=4)
    keys = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(1))
    values = mx.random.normal((1, kv_heads, length, dim), key=mx.random.key(2))
    q_keys, q_values = cache.update_and_fetch(keys, values)
    q = mx.random.normal((1, heads, queries, dim), key=mx.random.key(3))
    ours = cuda_attention._attention(q, q_keys, q_values, cache, dim ** -0.5, mask)
    with mx.stream(mx.cpu):  # the reference where its packed product runs
        theirs = quantized_scaled_dot_product_attention(q, q_keys, q_values, dim ** -0.5, mask,
                                                        group_size=64, bits=4)
    assert ours.shape == theirs.shape == (1, heads, queries, dim)
    assert mx.allclose(ours, theirs, rtol=1e-3, atol=1e-3)
