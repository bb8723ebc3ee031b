"""Records: a cache rebuilt from its records continues exactly as the original would."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import load

from rewind.cache import records as rec
from rewind.cache.blocks import BlockChain, root_key
from rewind.cache.serialize import decode_record, encode_record

ROOT = root_key("test", "layout")


def _prompt(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


class Recorder:
    """Snapshots each full block when the cache reaches its end, as the engine's checkpoints
    do (a sliding window only holds its last rows), then the point itself."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.chain = BlockChain(tokens, ROOT)
        self.records: dict[int, object] = {}  # block end -> spine record
        self.windows: dict[int, object] = {}  # block end -> window record

    def passed(self, cache: list) -> None:
        offset = rec.cache_offset(cache)
        for block in self.chain.full:
            if block.end == offset and block.end not in self.records:
                self.records[block.end] = rec.snapshot_kv(cache, block, "x")
                self.windows[block.end] = rec.snapshot_window(cache, block)

    def parts(self, cache: list, tokens: list[int] | None = None) -> rec.RestoreParts:
        """Every record a restore at len(tokens) needs; `tokens` may extend the recorded ones
        (a decode went on), whose full blocks keep their records."""
        if tokens is not None:
            self.tokens, self.chain = tokens, BlockChain(tokens, ROOT)
        point = self.chain.at(len(self.tokens))
        blocks = [block for block in self.chain.full if block.end <= point.start]
        blocks.append(point)  # a full point is the last full block itself
        recorded = [not block.partial and block.end in self.records for block in blocks]
        spine = [self.records[block.end] if known else rec.snapshot_kv(cache, block, "x")
                 for block, known in zip(blocks, recorded)]
        windows = [self.windows[block.end] if known else rec.snapshot_window(cache, block)
                   for block, known in zip(blocks, recorded)]
        return rec.RestoreParts(end=len(self.tokens), kv=spine,
                                state=rec.snapshot_state(cache, len(self.tokens)),
                                window=[w for w in windows if w is not None])


def _feed(model, tokens: list[int], cache: list, chunk: int = 256,
          recorder: Recorder | None = None) -> mx.array:
    """Prefill in chunks ending on multiples of `chunk`; the last position's logits."""
    position, logits = 0, None
    while position < len(tokens):
        end = min(len(tokens), (position // chunk + 1) * chunk)
        logits = model(mx.array([tokens[position:end]]), cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        position = end
        if recorder is not None:
            recorder.passed(cache)
    return logits


def _decode(model, cache: list, first: int, steps: int,
            recorder: Recorder | None = None) -> tuple[list[int], mx.array]:
    token, tokens, rows = first, [], []
    for _ in range(steps):
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        rows.append(logits)
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        if recorder is not None:
            mx.eval(logits)
            recorder.passed(cache)
    out = mx.concatenate(rows)
    mx.eval(out)
    return tokens, out


@pytest.fixture
def tiny(tiny_model_path: Callable[[str], Path], tiny_family: str):
    model, _ = load(str(tiny_model_path(tiny_family)))
    return model


@pytest.mark.parametrize("length", [512, 600])
@pytest.mark.parametrize("joined", ["per layer", "joined", "joined, one record from disk"])
def test_rebuilt_cache_continues_bit_for_bit(tiny, length: int, joined: str) -> None:
    """Rebuilt from its records, per layer or (as on a GPU) joined from every layer's stacked
    rows in one concatenation, or per layer again where a record has no stack (one read back
    from disk), the cache computes what the original does."""
    prompt, more = _prompt(length), _prompt(150, seed=1)
    original = make_prompt_cache(tiny)
    recorder = Recorder(prompt)
    _feed(tiny, prompt, original, recorder=recorder)
    parts = recorder.parts(original)
    if joined == "joined, one record from disk":
        parts.kv[0] = decode_record(encode_record(parts.kv[0]))
        assert parts.kv[0].stacked is None
    has_kv = any(rec.kind_of(layer) == rec.KV for _, layer in rec.leaves(original))
    assert (rec._joined(parts) is not None) == (has_kv and joined != "joined, one record from disk")
    rebuilt = rec.rebuild(make_prompt_cache(tiny), parts, joined=joined != "per layer")
    assert rec.cache_offset(rebuilt) == length
    # A prefill chunk, then decode steps, on both: the same computation on the same arrays.
    a = _feed_from(tiny, more, original)
    b = _feed_from(tiny, more, rebuilt)
    assert mx.array_equal(a, b)
    tokens_a, logits_a = _decode(tiny, original, 7, 6)
    tokens_b, logits_b = _decode(tiny, rebuilt, 7, 6)
    assert tokens_a == tokens_b
    assert mx.array_equal(logits_a, logits_b)


def _feed_from(model, tokens: list[int], cache: list) -> mx.array:
    logits = model(mx.array([tokens]), cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def test_kv_layers_are_preallocated_in_256_steps(tiny_model_path) -> None:
    model, _ = load(str(tiny_model_path("llama")))
    prompt = _prompt(600)
    original = make_prompt_cache(model)
    _feed(model, prompt, original)
    rebuilt = rec.rebuild(make_prompt_cache(model), Recorder(prompt).parts(original))
    for layer in rebuilt:
        assert isinstance(layer, KVCache)
        assert layer.offset == 600 and layer.keys.shape[2] == 768  # next multiple of 256
    for ours, theirs in zip(rebuilt, original):
        keys_a, values_a = ours.keys_and_values()
        keys_b, values_b = theirs.keys_and_values()
        assert mx.array_equal(keys_a, keys_b) and mx.array_equal(values_a, values_b)


def test_window_taken_after_rotation_continues(tiny_model_path) -> None:
    """Decode past the window (the rotating cache wraps around), snapshot, rebuild: the rows are
    the same set in another order, so logits agree to float rounding and tokens exactly."""
    model, _ = load(str(tiny_model_path("gemma3")))
    prompt = _prompt(300)
    original = make_prompt_cache(model)
    recorder = Recorder(prompt)
    logits = _feed(model, prompt, original, recorder=recorder)
    generated, _ = _decode(model, original, int(mx.argmax(logits).item()), 10)
    seen = prompt + [int(mx.argmax(logits).item())] + generated[:-1]
    rotating = [c for c in original if isinstance(c, RotatingKVCache)]
    assert rotating and all(c._idx < c.offset for c in rotating)  # wrapped around
    parts = recorder.parts(original, seen)
    rebuilt = rec.rebuild(make_prompt_cache(model), parts)
    tokens_a, logits_a = _decode(model, original, generated[-1], 8)
    tokens_b, logits_b = _decode(model, rebuilt, generated[-1], 8)
    assert tokens_a == tokens_b
    assert mx.allclose(logits_a, logits_b, atol=1e-4, rtol=1e-4)
    chunk = _prompt(100, seed=3)
    assert mx.allclose(_feed_from(model, chunk, original), _feed_from(model, chunk, rebuilt), atol=1e-4, rtol=1e-4)


def _random_rows(n: int, dim: int = 64, seed: int = 0) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return mx.random.normal((1, 2, n, dim), key=k1), mx.random.normal((1, 2, n, dim), key=k2)


def test_quantized_kv_deltas_round_trip() -> None:
    live = [QuantizedKVCache(group_size=32, bits=4)]
    for step, n in enumerate((256, 200, 100)):  # ends at 556: two full blocks and a partial one
        live[0].update_and_fetch(*_random_rows(n, seed=step))
    tokens = _prompt(556)
    parts = Recorder(tokens).parts(live)
    assert parts.state is None
    rebuilt = rec.rebuild([QuantizedKVCache(group_size=32, bits=4)], parts)
    assert rebuilt[0].offset == 556 and rebuilt[0].keys[0].shape[2] == 768
    ours, theirs = rebuilt[0].keys_and_values(), live[0].keys_and_values()
    for x, y in zip([*ours[0], *ours[1]], [*theirs[0], *theirs[1]]):
        assert mx.array_equal(x, y)
    more = _random_rows(40, seed=9)
    after_a = live[0].update_and_fetch(*more)
    after_b = rebuilt[0].update_and_fetch(*more)
    for x, y in zip([*after_a[0], *after_a[1]], [*after_b[0], *after_b[1]]):
        assert mx.array_equal(x, y)


def test_cache_list_with_keep_round_trips() -> None:
    """A CacheList of a full-attention and a rotating cache that keeps its first 2 rows."""

    def fresh() -> list:
        return [CacheList(KVCache(), RotatingKVCache(max_size=16, keep=2))]

    live = fresh()
    recorder = Recorder(_prompt(305))
    for step, n in enumerate((256, 44)):
        keys, values = _random_rows(n, dim=8, seed=step)
        live[0][0].update_and_fetch(keys, values)
        live[0][1].update_and_fetch(keys, values)
        recorder.passed(live)
    for step in range(5):  # and a few single rows: the rotating cache writes in place
        keys, values = _random_rows(1, dim=8, seed=10 + step)
        live[0][0].update_and_fetch(keys, values)
        live[0][1].update_and_fetch(keys, values)
    assert "0.0:KVCache;0.1:RotatingKVCache(max_size=16,keep=2)" == rec.describe_layout(live)
    parts = recorder.parts(live)
    rebuilt = rec.rebuild(fresh(), parts)
    assert rebuilt[0][1].keys.shape[2] == 16
    window = rebuilt[0][1].keys
    first_rows = _random_rows(256, dim=8, seed=0)[0][..., :2, :]
    assert mx.array_equal(window[..., :2, :], first_rows)  # the kept rows survive
    for chunk in (30, 1, 1):
        keys, values = _random_rows(chunk, dim=8, seed=100 + chunk)
        a = live[0][1].update_and_fetch(keys, values)
        b = rebuilt[0][1].update_and_fetch(keys, values)
        # Same rows; the live cache may hold them rotated, so compare as sets of rows.
        rows_a = np.sort(np.array(a[0]).reshape(-1, 8), axis=0)
        rows_b = np.sort(np.array(b[0]).reshape(-1, 8), axis=0)
        assert np.array_equal(rows_a, rows_b)
        c = live[0][0].update_and_fetch(keys, values)
        d = rebuilt[0][0].update_and_fetch(keys, values)
        assert mx.array_equal(c[0], d[0]) and mx.array_equal(c[1], d[1])


def test_records_are_copies_of_only_their_rows() -> None:
    live = [KVCache()]
    live[0].update_and_fetch(*_random_rows(600))
    chain = BlockChain(_prompt(600), ROOT)
    record = rec.snapshot_kv(live, chain.full[1], "x")
    saved = np.array(record.arrays["0.k"])
    assert record.arrays["0.k"].shape == (1, 2, 256, 64)
    assert record.nbytes == 2 * 256 * 2 * 64 * 4 + 256 * 4  # K and V rows plus the tokens
    # Overwrite the live buffer in place (what a trim and a new prefill do).
    live[0].trim(400)
    live[0].update_and_fetch(*_random_rows(300, seed=5))
    assert np.array_equal(np.array(record.arrays["0.k"]), saved)


def test_identity_check() -> None:
    tokens = _prompt(600)
    live = [KVCache()]
    live[0].update_and_fetch(*_random_rows(600))
    chain = BlockChain(tokens, ROOT)
    record = rec.snapshot_kv(live, chain.full[1], "digest")
    assert rec.verify_kv(record, chain.full[1], "digest")
    assert not rec.verify_kv(record, chain.full[1], "other-images")
    assert not rec.verify_kv(record, chain.full[0], "digest")  # another span
    other = list(tokens)
    other[300] += 1
    assert not rec.verify_kv(record, BlockChain(other, ROOT).full[1], "digest")  # other tokens
    other = list(tokens)
    other[3] += 1
    # Same block tokens, another prefix: chained from another key.
    assert not rec.verify_kv(record, BlockChain(other, ROOT).full[1], "digest")


def test_unsupported_cache_class_is_refused() -> None:
    with pytest.raises(rec.UnsupportedCacheError):
        rec.describe_layout([KVCache(), ChunkedKVCache(chunk_size=64)])


def test_window_rows_are_stored_once_and_only_while_held(tiny_model_path) -> None:
    """A block keeps the rows of its sliding-window layers that a later point can need (the
    last max_size - keep), full-attention layers all of theirs; a block whose window rows have
    left the live cache cannot be stored from it."""
    model, _ = load(str(tiny_model_path("gemma3")))
    prompt = _prompt(600)
    cache = make_prompt_cache(model)
    recorder = Recorder(prompt)
    _feed(model, prompt, cache, recorder=recorder)
    spine, window = recorder.records[512], recorder.windows[512]
    for path, layer in rec.leaves(cache):
        if isinstance(layer, RotatingKVCache):
            assert f"{path}.k" not in spine.arrays
            assert window.arrays[f"{path}.k"].shape[2] == layer.max_size - layer.keep == 64
            assert window.meta[f"{path}.from"] == str(512 - 64)
        else:
            assert spine.arrays[f"{path}.k"].shape[2] == 256 and f"{path}.k" not in window.arrays
    rec.snapshot_kv(cache, BlockChain(prompt, ROOT).full[0], "x")  # full attention: all held
    with pytest.raises(rec.RowsGoneError):
        rec.snapshot_window(cache, BlockChain(prompt, ROOT).full[0])  # at 600: 192..256 gone
    assert rec.window_blocks(cache, [(0, 256), (256, 512), (512, 600)], 600) == [2]  # 536..600
    assert rec.window_blocks(cache, [(0, 256), (256, 512), (512, 530)], 530) == [1, 2]  # 466..530


def test_a_restore_without_the_window_rows_is_refused() -> None:
    """The spine must hold every row of the window at the point; a gap is an error the prompt
    cache turns into an earlier point, never a wrong cache."""
    live = [RotatingKVCache(max_size=16)]
    recorder = Recorder(_prompt(300))
    for step, n in enumerate((256, 44)):
        live[0].update_and_fetch(*_random_rows(n, dim=8, seed=step))
        recorder.passed(live)
    parts = recorder.parts(live)
    assert rec.window_covered([RotatingKVCache(max_size=16)], parts)
    parts.window[-1].arrays.pop("0.k")  # the point's own rows 284..300
    assert not rec.window_covered([RotatingKVCache(max_size=16)], parts)
    with pytest.raises(ValueError, match="rows"):
        rec.rebuild([RotatingKVCache(max_size=16)], parts)
