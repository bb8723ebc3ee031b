"""Records survive the trip to bytes and back exactly, for every dtype a cache holds."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import safetensors.numpy

from rewind.cache.serialize import (
    Record,
    RecordFormatError,
    decode_record,
    encode_record,
    layout,
)

DTYPES = [
    mx.bfloat16,
    mx.float16,
    mx.float32,
    mx.float64,
    mx.uint8,
    mx.int8,
    mx.uint16,
    mx.int16,
    mx.uint32,
    mx.int32,
    mx.uint64,
    mx.int64,
    mx.bool_,
]


def bit_exact(a: mx.array, b: mx.array) -> bool:
    """Same dtype, shape and bits (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    if a.dtype == mx.bool_:
        return bool(mx.array_equal(a, b))
    return bool(mx.array_equal(a.view(width), b.view(width)))


def random_array(dtype: mx.Dtype, shape: tuple[int, ...], seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    if dtype == mx.bool_:
        return mx.array(rng.integers(0, 2, size=shape).astype(bool))
    if dtype in (mx.bfloat16, mx.float16, mx.float32, mx.float64):
        # Every bit pattern, NaNs and infinities too: the point is exactness of the bytes.
        width = {mx.bfloat16: np.uint16, mx.float16: np.uint16, mx.float32: np.uint32}
        words = rng.integers(0, 2**63, size=shape, dtype=np.uint64)
        raw = mx.array(words.astype(width.get(dtype, np.uint64)))
        return raw.view(dtype)
    numpy_dtype = np.dtype(str(dtype).split(".")[-1])
    info = np.iinfo(numpy_dtype)
    return mx.array(rng.integers(info.min, info.max, size=shape, dtype=numpy_dtype, endpoint=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_round_trip_is_bit_exact_for_every_dtype(dtype: mx.Dtype) -> None:
    if dtype == mx.float64 and mx.default_device() != mx.cpu:
        with mx.stream(mx.cpu):  # MLX computes float64 on the CPU only
            check_round_trip(dtype)
    else:
        check_round_trip(dtype)


def check_round_trip(dtype: mx.Dtype) -> None:
    shapes = [(2, 3, 5), (), (0, 4), (1,)]
    arrays = {f"t{i}": random_array(dtype, shape, seed=i) for i, shape in enumerate(shapes)}
    assert all(array.dtype == dtype for array in arrays.values())
    record = Record(arrays, {"kind": "kv", "tokens": "256"})
    mx.eval(list(arrays.values()))

    blob = encode_record(record)
    back = decode_record(blob)

    assert len(blob) == layout(record).size
    assert back.meta == record.meta
    assert list(back.arrays) == list(record.arrays)
    for name, array in record.arrays.items():
        assert bit_exact(back.arrays[name], array), name
    assert back.nbytes == record.nbytes


def test_non_contiguous_arrays_are_written_as_their_values() -> None:
    base = mx.arange(64, dtype=mx.float32).reshape(8, 8)
    sliced = base[:, 2:5]  # a strided view of a bigger buffer
    transposed = base.T
    record = Record({"sliced": sliced, "transposed": transposed})
    back = decode_record(encode_record(record))
    assert bool(mx.array_equal(back.arrays["sliced"], sliced))
    assert bool(mx.array_equal(back.arrays["transposed"], transposed))
    assert back.nbytes == 8 * 3 * 4 + 64 * 4


def test_blob_is_standard_safetensors(tmp_path: Path) -> None:
    record = Record(
        {
            "keys": mx.random.normal((1, 2, 4, 8), key=mx.random.key(0)).astype(mx.bfloat16),
            "offset": mx.array([256], dtype=mx.int32),
            "state": mx.random.normal((3, 3), key=mx.random.key(1)),
        },
        {"layer_kind": "rotating"},
    )
    blob = encode_record(record)
    (header_len,) = struct.unpack("<Q", blob[:8])
    assert (8 + header_len) % 8 == 0  # data aligned as safetensors writers do
    header = json.loads(blob[8 : 8 + header_len])
    assert header["keys"]["dtype"] == "BF16"

    # Two independent readers: MLX's loader (knows bf16) and the safetensors package (numpy).
    path = tmp_path / "record.safetensors"
    path.write_bytes(blob)
    loaded, meta = mx.load(str(path), return_metadata=True)
    assert meta == {"layer_kind": "rotating"}
    for name, array in record.arrays.items():
        assert bit_exact(loaded[name], array), name
    plain = Record({k: v for k, v in record.arrays.items() if v.dtype != mx.bfloat16})
    by_package = safetensors.numpy.load(encode_record(plain))
    for name, array in plain.arrays.items():
        np.testing.assert_array_equal(by_package[name], np.array(array))


def test_real_cache_state_round_trips(tiny_loaded) -> None:
    """The arrays a tiny Gemma 3 leaves in its caches after a prompt come back identical."""
    from mlx_lm.models.cache import make_prompt_cache

    loaded = tiny_loaded("gemma3")
    cache = make_prompt_cache(loaded.model)
    tokens = mx.array([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37]])
    loaded.model(tokens, cache=cache)
    arrays: dict[str, mx.array] = {}
    for index, layer in enumerate(cache):
        keys, values = layer.state[:2]  # the rotating layers also carry offsets
        arrays[f"{index}.keys"] = keys
        arrays[f"{index}.values"] = values
    mx.eval(list(arrays.values()))
    record = Record(arrays, {"offset": str(cache[0].offset)})

    back = decode_record(encode_record(record))
    for name, array in arrays.items():
        assert bit_exact(back.arrays[name], array), name
    assert back.meta["offset"] == "10"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda blob: blob[:5],  # shorter than the length prefix
        lambda blob: struct.pack("<Q", 1 << 40) + blob[8:],  # header longer than the blob
        lambda blob: blob[:8] + b"[" + blob[9:],  # JSON broken
        lambda blob: blob[:-1],  # data truncated
        lambda blob: blob.replace(b'"F32"', b'"X32"'),  # unknown dtype
        lambda blob: blob.replace(b'"data_offsets":[0,', b'"data_offsets":[4,'),  # bad offsets
    ],
    ids=["tiny", "long-header", "json", "truncated", "dtype", "offsets"],
)
def test_malformed_blobs_raise_record_format_error(mangle) -> None:
    record = Record({"a": mx.arange(6, dtype=mx.float32)}, {"m": "x"})
    with pytest.raises(RecordFormatError):
        decode_record(mangle(encode_record(record)))


def test_metadata_must_be_strings() -> None:
    with pytest.raises(TypeError):
        encode_record(Record({"a": mx.zeros((1,))}, {"tokens": 256}))  # type: ignore[dict-item]
