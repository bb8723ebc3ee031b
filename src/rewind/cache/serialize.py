"""A cache record and its byte form: one safetensors blob per record.

The blob is standard safetensors (8-byte little-endian header length, a JSON header with each
tensor's dtype, shape and data offsets plus `__metadata__`, then the raw bytes), written here
rather than by the `safetensors` package because numpy, which that package goes through, has no
bfloat16. bfloat16 tensors travel as their raw 16-bit words under safetensors' own "BF16" dtype,
so the true dtype is in the header and any safetensors reader (`mx.load`, torch) reads the blob.

The header depends only on names, dtypes, shapes and metadata, so its size, and therefore the
blob's, is known before any array byte is touched: the store budgets a record on the caller's
thread and converts the arrays on the writer thread.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import numpy as np

# mlx dtype <-> safetensors dtype code <-> numpy dtype of the raw words on disk.
_CODES: dict[mx.Dtype, str] = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}
_MX_BY_CODE: dict[str, mx.Dtype] = {code: dtype for dtype, code in _CODES.items()}
_NUMPY_BY_CODE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bfloat16 words; viewed back as bfloat16 inside mlx
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<u8"),  # raw words too: mx.array() would narrow float64 to float32
}
_HEADER_ALIGN = 8  # safetensors pads the header so that data starts 8-byte aligned
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger length means a corrupt blob


class RecordFormatError(ValueError):
    """A blob that is not a well-formed record (corrupt, truncated, or another format)."""


@dataclass
class Record:
    """A cache checkpoint: named, already evaluated arrays plus string metadata."""

    arrays: dict[str, mx.array]
    meta: dict[str, str] = field(default_factory=dict)
    # In memory only (a record made in this process, rewind.cache.records.snapshot_kv): one
    # array [n, ...] whose rows are the named arrays in this order, each of `arrays` a view of
    # one row. A restore then joins the blocks of every layer in one copy. Not written to
    # disk; a record read back has none.
    stacked: tuple[mx.array, tuple[str, ...]] | None = field(default=None, compare=False,
                                                              repr=False)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays.values())


@dataclass(frozen=True)
class EncodedLayout:
    """The header of a record's blob, and the blob's total size, before any array is read."""

    header: bytes  # the length prefix, the JSON header and its padding
    size: int


def layout(record: Record) -> EncodedLayout:
    """The safetensors header of `record` and the size its blob will have."""
    tensors: dict[str, object] = {}
    offset = 0
    for name, array in record.arrays.items():
        code = _CODES.get(array.dtype)
        if code is None:
            raise TypeError(f"array {name!r}: dtype {array.dtype} has no safetensors code")
        tensors[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    for key, value in record.meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"record metadata must map str to str, got {key!r}: {value!r}")
    if record.meta:
        tensors["__metadata__"] = dict(record.meta)
    text = json.dumps(tensors, separators=(",", ":")).encode("utf-8")
    padded = len(text) + (-(8 + len(text)) % _HEADER_ALIGN)
    header = struct.pack("<Q", padded) + text + b" " * (padded - len(text))
    return EncodedLayout(header=header, size=len(header) + offset)


def wire_arrays(record: Record) -> list[mx.array]:
    """The arrays as the blob holds them: bfloat16 reinterpreted as its 16-bit words.

    This is an MLX operation (lazy): run and evaluate it on the thread that drives MLX, so the
    writer thread only reads finished buffers and never evaluates a graph concurrently.
    """
    return [
        array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
        for array in record.arrays.values()
    ]


def array_buffers(words: list[mx.array]) -> Iterator[memoryview]:
    """Flat byte views of evaluated wire arrays, in blob order (numpy only, any thread).

    Strided arrays (slices, transposes) are copied into row order by numpy here.
    """
    for array in words:
        flat = np.ascontiguousarray(np.asarray(array))
        if flat.dtype.byteorder == ">":  # never on the platforms MLX runs on; be exact anyway
            flat = flat.astype(flat.dtype.newbyteorder("<"))
        yield memoryview(flat.reshape(-1).view(np.uint8))


def encode_record(record: Record) -> bytes:
    """The record as one safetensors blob."""
    encoded = layout(record)
    words = wire_arrays(record)
    mx.eval(words)
    return b"".join([encoded.header, *array_buffers(words)])


def decode_record(blob: bytes | bytearray | memoryview) -> Record:
    """A record back from its blob; raises RecordFormatError on anything malformed."""
    view = memoryview(blob).cast("B")
    if len(view) < 8:
        raise RecordFormatError(f"blob of {len(view)} bytes is shorter than a header length")
    (header_len,) = struct.unpack_from("<Q", view, 0)
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(view):
        raise RecordFormatError(f"header length {header_len} does not fit a {len(view)}-byte blob")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordFormatError(f"header is not JSON: {error}") from error
    if not isinstance(header, dict):
        raise RecordFormatError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise RecordFormatError("__metadata__ must map str to str")
    data = view[8 + header_len :]
    arrays: dict[str, mx.array] = {}
    for name, spec in header.items():
        arrays[name] = _decode_tensor(name, spec, data)
    return Record(arrays=arrays, meta=dict(meta))


def _decode_tensor(name: str, spec: object, data: memoryview) -> mx.array:
    try:
        code = spec["dtype"]  # type: ignore[index]
        shape = [int(n) for n in spec["shape"]]  # type: ignore[index]
        start, end = (int(n) for n in spec["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as error:
        raise RecordFormatError(f"tensor {name!r}: malformed entry {spec!r}") from error
    words_dtype = _NUMPY_BY_CODE.get(code)
    if words_dtype is None:
        raise RecordFormatError(f"tensor {name!r}: unknown dtype {code!r}")
    count = 1
    for n in shape:
        if n < 0:
            raise RecordFormatError(f"tensor {name!r}: negative dimension in {shape}")
        count *= n
    if not 0 <= start <= end <= len(data) or end - start != count * words_dtype.itemsize:
        raise RecordFormatError(
            f"tensor {name!r}: offsets {start}..{end} do not hold {shape} {code} "
            f"in {len(data)} data bytes"
        )
    words = np.frombuffer(data, dtype=words_dtype, count=count, offset=start).reshape(shape)
    array = mx.array(words)  # copies: the record must not keep the read buffer alive
    if array.dtype != _MX_BY_CODE[code]:
        array = array.view(_MX_BY_CODE[code])
    return array
