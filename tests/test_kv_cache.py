"""Rewind's growing KV caches hold exactly what mlx-lm's hold, in buffers that grow along a
geometric ladder of capacities (multiples of 256) with the live rows at the buffer's start; the
model computes the same logits with them, and the memory budget counts their capacity."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
    save_prompt_cache,
)

from rewind.cache import capacity, kv
from rewind.cache.kv import GrowingBatchKVCache, GrowingKVCache, make_cache


def _rows(n: int, seed: int, heads: int = 2, dim: int = 8) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, heads, n, dim), key=k1), mx.random.normal((1, heads, n, dim), key=k2)


def _assert_contiguous_slice(cache: GrowingKVCache | GrowingBatchKVCache) -> None:
    """The layout MLX's CUDA decode attention needs: capacity a multiple of 256, and the live
    rows the slice [..., :rows, :] of the buffer itself (not of a view into it)."""
    for buffer, live in zip((cache.keys, cache.values), cache.keys_and_values()):
        assert buffer.shape[2] % capacity.STEP == 0
        assert mx.array_equal(live, buffer[..., :live.shape[2], :])


def test_capacity_ladder() -> None:
    rungs = [capacity.capacity_for(n) for n in range(0, 70000, 7)]
    ladder = sorted(set(rungs))
    assert ladder[:10] == [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert all(rung % 256 == 0 for rung in ladder)
    assert all(1.33 <= b / a <= 1.5 for a, b in zip(ladder[2:], ladder[3:]))  # geometric
    for n in range(1, 70000, 7):
        held = capacity.capacity_for(n)
        assert n <= held and (n <= 512 or held - n <= held / 3)  # a third spare at most
    assert capacity.next_capacity(1025, bound=1100) == 1280  # never past the bound (rounded up)
    assert capacity.next_capacity(2000, bound=1100) == 2048  # unless the rows need it


def test_growing_cache_holds_what_kvcache_holds() -> None:
    ours, theirs = GrowingKVCache(), KVCache()
    growths, their_growths = 0, 0
    for step, n in enumerate([300, 300, 100] + [1] * 700 + [5, 200]):
        rows = _rows(n, seed=step)
        before = None if ours.keys is None else ours.keys.shape[2]
        their_before = None if theirs.keys is None else theirs.keys.shape[2]
        got = ours.update_and_fetch(*rows)
        want = theirs.update_and_fetch(*rows)
        growths += before != ours.keys.shape[2]
        their_growths += their_before != theirs.keys.shape[2]
        assert got[0].shape == want[0].shape
        assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
        _assert_contiguous_slice(ours)
    assert ours.offset == theirs.offset == 1605
    assert growths == 5  # 512, then 768, 1024, 1536, 2048: up the ladder
    assert their_growths == 6 and theirs.keys.shape[2] % capacity.STEP != 0  # 256 a time, off-grid
    assert ours.trim(10) == 10 and theirs.trim(10) == 10
    rows = _rows(3, seed=99)
    assert mx.array_equal(ours.update_and_fetch(*rows)[0], theirs.update_and_fetch(*rows)[0])


def test_bound_caps_growth() -> None:
    cache = GrowingKVCache(bound=1100)
    cache.update_and_fetch(*_rows(1024, seed=0))
    cache.update_and_fetch(*_rows(1, seed=1))
    assert cache.keys.shape[2] == 1280  # round_up(1100), not the ladder's 1536


def _batch_pair(lengths: list[int]) -> tuple[BatchKVCache, GrowingBatchKVCache]:
    theirs, ours = [], []
    for index, n in enumerate(lengths):
        a, b = KVCache(), GrowingKVCache()
        if n:
            rows = _rows(n, seed=index)
            a.update_and_fetch(*rows)
            b.update_and_fetch(*rows)
        theirs.append(a)
        ours.append(b)
    return BatchKVCache.merge(theirs), GrowingKVCache.merge(ours)


def _assert_same_batch(ours: GrowingBatchKVCache, theirs: BatchKVCache) -> None:
    for x, y in zip(ours.keys_and_values(), theirs.keys_and_values()):
        assert x.shape == y.shape and mx.array_equal(x, y)
    assert mx.array_equal(ours.offset, theirs.offset)
    assert mx.array_equal(ours.left_padding, theirs.left_padding)
    assert mx.array_equal(ours.make_mask(1), theirs.make_mask(1))
    _assert_contiguous_slice(ours)


def test_merge_extend_filter_extract_match_mlx_lm() -> None:
    theirs, ours = _batch_pair([300, 40])
    assert type(ours) is GrowingBatchKVCache
    _assert_same_batch(ours, theirs)
    for step in range(3):  # decode steps: one row each
        keys = mx.random.normal((2, 2, 1, 8), key=mx.random.key(100 + step))
        ours.update_and_fetch(keys, keys)
        theirs.update_and_fetch(keys, keys)
        _assert_same_batch(ours, theirs)
    more_theirs, more_ours = _batch_pair([700])
    theirs.extend(more_theirs)
    ours.extend(more_ours)
    _assert_same_batch(ours, theirs)
    theirs.filter([1, 2])  # the shorter rows: their common left padding goes
    ours.filter([1, 2])
    _assert_same_batch(ours, theirs)
    for row in range(2):
        alone_ours, alone_theirs = ours.extract(row), theirs.extract(row)
        assert type(alone_ours) is GrowingKVCache and alone_ours.offset == alone_theirs.offset
        assert mx.array_equal(alone_ours.keys_and_values()[0], alone_theirs.keys_and_values()[0])
        _assert_contiguous_slice(alone_ours)


def test_extend_refits_an_mlx_lm_batch() -> None:
    """A batch from mlx-lm's merge has an exact-size buffer; extending with it keeps STEP."""
    _, ours = _batch_pair([30])
    foreign, _ = _batch_pair([300])
    ours.extend(foreign)
    _assert_contiguous_slice(ours)
    assert ours.keys_and_values()[0].shape[2] == 300


def test_make_cache_swaps_only_plain_kv_layers(tiny_loaded, tiny_family: str) -> None:
    model = tiny_loaded(tiny_family).model
    for ours, theirs in zip(make_cache(model), make_prompt_cache(model)):
        if type(theirs) is KVCache:
            assert type(ours) is GrowingKVCache
        else:
            assert type(ours) is type(theirs)
    assert any(type(layer) is GrowingKVCache for layer in make_cache(model))
    if tiny_family != "llama":  # the families with their own make_cache keep their other layers
        assert any(isinstance(layer, (RotatingKVCache, ArraysCache)) for layer in make_cache(model))


def test_make_cache_swaps_inside_cache_lists() -> None:
    class Model:
        def make_cache(self) -> list:
            return [CacheList(KVCache(), RotatingKVCache(max_size=16))]

    (layer,) = make_cache(Model())
    assert type(layer) is CacheList
    assert type(layer[0]) is GrowingKVCache and type(layer[1]) is RotatingKVCache


def test_same_logits_as_mlx_lm_caches(tiny_loaded, tiny_family: str) -> None:
    """Prefill in chunks past a growth, then decode: the logits are those of mlx-lm's caches."""
    model = tiny_loaded(tiny_family).model
    prompt = [(7 * i) % 400 + 10 for i in range(600)]
    results = []
    for cache in (make_cache(model), make_prompt_cache(model)):
        outputs = []
        for start, end in ((0, 300), (300, 600)):
            outputs.append(model(mx.array([prompt[start:end]]), cache=cache)[:, -1, :])
        token = mx.argmax(outputs[-1], axis=-1).reshape(1, 1)
        for _ in range(4):
            logits = model(token, cache=cache)[:, -1, :]
            outputs.append(logits)
            token = mx.argmax(logits, axis=-1).reshape(1, 1)
        mx.eval(outputs)
        results.append(outputs)
    for ours, theirs in zip(*results):
        if mx.default_device() == mx.cpu:
            assert mx.array_equal(ours, theirs)
        else:
            # On CUDA a prompt call over our cache attends at padded shapes
            # (rewind.kernels.prompt_shapes), which round apart from mlx-lm's exact ones in
            # the last bits; a wrong key or position would part by far more.
            assert mx.allclose(ours, theirs, rtol=1e-2, atol=1e-2)
            assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))


def test_saved_cache_loads_as_growing(tmp_path: Path) -> None:
    from rewind.commands.cache_prompt import _load

    live = [GrowingKVCache(), CacheList(GrowingKVCache(), RotatingKVCache(max_size=16, keep=2))]
    for step, n in enumerate((300, 1, 1)):
        rows = _rows(n, seed=step)
        live[0].update_and_fetch(*rows)
        live[1][0].update_and_fetch(*rows)
        live[1][1].update_and_fetch(*rows)
    assert live[0].keys.shape[2] == 512 and live[0].state[0].shape[2] == 512
    path = tmp_path / "saved.safetensors"
    save_prompt_cache(str(path), live, {"k": "v"})
    loaded, metadata = _load(str(path))
    assert metadata == {"k": "v"}
    assert type(loaded[0]) is GrowingKVCache and type(loaded[1][0]) is GrowingKVCache
    assert type(loaded[1][1]) is RotatingKVCache
    for ours, theirs in ((loaded[0], live[0]), (loaded[1][0], live[1][0])):
        assert ours.offset == theirs.offset == 302
        assert mx.array_equal(ours.keys_and_values()[0], theirs.keys_and_values()[0])
        _assert_contiguous_slice(ours)


def test_state_drops_the_spare_rows_of_a_trimmed_cache() -> None:
    cache = GrowingKVCache()
    cache.update_and_fetch(*_rows(1025, seed=0))
    assert cache.keys.shape[2] == 1536
    cache.trim(600)
    keys, values, offset = cache.state
    assert keys.shape[2] == values.shape[2] == 512 and offset == 425
    restored = GrowingKVCache.from_state(cache.state)
    assert mx.array_equal(restored.keys_and_values()[0], cache.keys_and_values()[0])


def test_from_saved_refuses_a_name_that_is_no_cache() -> None:
    with pytest.raises(ValueError, match="no cache class"):
        kv.from_saved("make_prompt_cache", [])


def test_capacity_depends_on_the_tokens_alone() -> None:
    """However the tokens arrive (chunks, single rows, a merge), a cache of n tokens has the
    ladder's capacity for n, which is what the memory budget counts."""
    import random

    from rewind.models.memory_estimate import KvShape

    rng = random.Random(0)
    for trial in range(5):
        cache = GrowingKVCache()
        while cache.offset < 5000:
            cache.update_and_fetch(*_rows(rng.choice([1, 1, 7, 64, 300, 512, 1000]), seed=trial))
            assert cache.keys.shape[2] == capacity.capacity_for(cache.offset)
    merged = GrowingKVCache.merge([cache])
    assert merged.keys.shape[2] == capacity.capacity_for(cache.offset)
    shape = KvShape(full_layers=1, window_layers=0, window=0, linear_layers=0, token_bytes=1,
                    state_bytes=0)
    assert [shape.bytes_for(n) for n in (1, 600, 1025, 5000)] == [256, 768, 1536, 6144]


def _filled(n: int, seed: int) -> GrowingKVCache:
    cache = GrowingKVCache()
    cache.update_and_fetch(*_rows(n, seed))
    return cache


def test_an_unpadded_batch_asks_for_no_mask() -> None:
    """One row, or rows of one length: no array mask (what a plain KVCache gives), so MLX's
    fused attention (cuDNN on CUDA) can run the decode step; padded rows keep mlx-lm's mask,
    and the answer is the same either way."""
    alone = GrowingBatchKVCache.merge([_filled(300, 1)])
    assert alone.make_mask(1) is None and alone.make_mask(4) == "causal"
    assert isinstance(alone.make_mask(1, return_array=True), mx.array)
    padded = GrowingBatchKVCache.merge([_filled(300, 1), _filled(40, 2)])
    mask = padded.make_mask(1)
    assert isinstance(mask, mx.array)
    padded.extend(GrowingBatchKVCache.merge([_filled(300, 3)]))
    padded.filter([0, 2])  # the two rows of 300: no padding left
    assert padded.make_mask(1) is None
    # The unmasked decode step attends exactly as the masked one.
    query = mx.random.normal((2, 2, 1, 8), key=mx.random.key(7))
    array_mask = padded.make_mask(1, return_array=True)  # as a model: before the update
    keys, values = padded.update_and_fetch(query, query)
    plain = mx.fast.scaled_dot_product_attention(query, keys, values, scale=0.3, mask=None)
    masked = mx.fast.scaled_dot_product_attention(query, keys, values, scale=0.3,
                                                  mask=array_mask)
    assert mx.allclose(plain, masked, atol=1e-6)
