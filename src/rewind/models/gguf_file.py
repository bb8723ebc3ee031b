"""A fast reader of GGUF headers: metadata, tensor table, and each tensor's raw bytes (memory-mapped).

Why not `gguf.GGUFReader`: it parses every element of every metadata array into its own numpy view,
which for Gemma's 262,144-word vocabulary (three arrays of it) takes close to a minute on a busy
2-core machine. Here numeric arrays are one `np.frombuffer` each and strings a tight loop (< 1 s).
Dequantization itself stays with the `gguf` package (`gguf.quants.dequantize`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf spec): id -> (struct format, numpy dtype); 8 = string, 9 = array.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """A GGUF file that is corrupt, truncated, or describes something Rewind cannot convert."""


@dataclass(frozen=True)
class GgufTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: fastest-varying first (numpy shape is the reverse)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


class GgufFile:
    """An open GGUF: `metadata` (key -> python value or numpy array), `tensors` (name -> GgufTensor),
    and `raw(tensor)` (a read-only numpy view of its bytes, shaped as `gguf.quants.dequantize` wants)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        with self.path.open("rb") as handle:
            try:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise GgufError(f"{self.path}: not a GGUF file (empty)") from exc
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GgufTensor] = {}
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise GgufError(f"{self.path}: truncated or corrupt GGUF header at byte {self._pos}: {exc}") from exc

    # -- header ---------------------------------------------------------------------------------
    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._read("<Q")
        if self._pos + length > len(self._map):
            raise GgufError(f"{self.path}: string of {length} bytes runs past the end of the file")
        text = self._map[self._pos:self._pos + length].decode("utf-8")
        self._pos += length
        return text

    def _read_value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._read_string()
        if value_type == _ARRAY:
            item_type, count = self._read("<I"), self._read("<Q")
            if item_type == _STRING:
                return [self._read_string() for _ in range(count)]
            if item_type not in _SCALAR_TYPES:
                raise GgufError(f"{self.path}: unknown array item type {item_type}")
            dtype = np.dtype(_SCALAR_TYPES[item_type][1])
            end = self._pos + count * dtype.itemsize
            if end > len(self._map):
                raise GgufError(f"{self.path}: array of {count} items runs past the end of the file")
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos = end
            return values
        if value_type not in _SCALAR_TYPES:
            raise GgufError(f"{self.path}: unknown metadata value type {value_type}")
        return self._read(_SCALAR_TYPES[value_type][0])

    def _parse(self) -> None:
        if self._map[:4] != GGUF_MAGIC:
            raise GgufError(f"{self.path}: not a GGUF file (magic {bytes(self._map[:4])!r}, expected b'GGUF')")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GgufError(f"{self.path}: unsupported GGUF version {version} (big-endian files are not supported)")
        tensor_count, kv_count = self._read("<Q"), self._read("<Q")
        for _ in range(kv_count):
            key = self._read_string()
            self.metadata[key] = self._read_value(self._read("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._read_string()
            n_dims = self._read("<I")
            dims = tuple(self._read("<Q") for _ in range(n_dims))
            type_id, offset = self._read("<I"), self._read("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (self._pos + alignment - 1) // alignment * alignment
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError as exc:
                raise GgufError(f"{self.path}: tensor {name!r} has unknown ggml type {type_id}") from exc
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims)) if dims else 1
            if n_elements % block_size:
                raise GgufError(f"{self.path}: tensor {name!r} of shape {dims} does not fill whole "
                                f"{qtype.name} blocks of {block_size}")
            nbytes = n_elements // block_size * type_size
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise GgufError(f"{self.path}: tensor {name!r} ({qtype.name}, {nbytes} bytes at {start}) runs "
                                f"past the end of the file ({len(self._map)} bytes): the file is truncated")
            self.tensors[name] = GgufTensor(name, dims, qtype, start, nbytes)

    # -- access ---------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GgufError(f"{self.path}: no general.architecture in its metadata")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata, e.g. arch_value('block_count')."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, tensor: GgufTensor) -> np.ndarray:
        """The tensor's bytes as a numpy view: float types in their dtype and numpy shape, block-quantized
        types as uint8 rows (numpy shape with the last axis in bytes), as gguf.quants.dequantize expects."""
        block_size, type_size = GGML_QUANT_SIZES[tensor.qtype]
        shape = tensor.numpy_shape or (1,)
        flat = np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
        if block_size == 1 and tensor.qtype != GGMLQuantizationType.BF16:
            dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                     GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                     GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                     GGMLQuantizationType.I64: np.int64}[tensor.qtype]
            return flat.view(dtype).reshape(shape)
        return flat.reshape(*shape[:-1], shape[-1] // block_size * type_size)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # numpy views of tensors are still alive; the map closes when they are collected

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
