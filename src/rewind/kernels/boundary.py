"""The one door to the compiled CPU kernels: every call goes through `Kernels`, which checks each
buffer against what the C code will read or write before passing a pointer.

The rule for memory that native code reads (issue 23):
- A kernel reads and writes only NumPy arrays handed to the method that calls it (NumPy views
  of evaluated MLX arrays included: such a view holds the MLX array, and so its buffer). The
  method holds every one of them in its frame until the C call returns, and the C call returns
  only when every thread of the kernels' pool has finished with them (pool.c).
- Long-lived buffers (weights, norm vectors, RoPE frequencies) are checked once, when their
  `MatrixArgs` / `LayerArgs` are built; those objects own the arrays their structs point into,
  and every call that uses a struct holds its object.
- Before each call: the dtype, the exact shape the C code indexes, the strides (C order, or a
  unit last stride where the kernel takes strides), a writable buffer for outputs, a non-null
  pointer, and the whole extent of each view inside the memory its owning array holds (an
  `as_strided` view can point anywhere; this catches it). A bad call raises `KernelCallError`;
  nothing is read.
- Nothing else in Rewind calls the library's functions or takes a kernel pointer.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import numpy as np

from rewind.kernels import native

_F32, _I64, _U8 = np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.uint8)
_WEIGHT_DTYPES = {native.FORM_F32: _F32, native.FORM_BF16: np.dtype(np.uint16),
                  native.FORM_INT8: np.dtype(np.int8)}
_KV_DTYPES = {native.FORM_F32: _F32, native.FORM_BF16: np.dtype(np.uint16)}


class KernelCallError(ValueError):
    """A kernel call whose buffers do not match what the kernel would read or write."""


# id -> (a weak reference to an array that owns its memory, its [low, high)): the scratch
# buffers whose views every decode step checks ~15 times a layer. An owning array's buffer
# does not move while a view of it lives (NumPy refuses to resize it then), and the entry goes
# with the array; the weak reference also tells a reused id from its first owner.
_OWNED_BOUNDS: dict[int, tuple[weakref.ref, int, int]] = {}


def _forget_owner(key: int) -> None:
    _OWNED_BOUNDS.pop(key, None)


def _root(array: np.ndarray) -> np.ndarray:
    """The array at the root of `array`'s chain of views (through as_strided's wrapper objects
    too): the one whose memory the chain holds."""
    owner, base = array, array.base
    while base is not None:
        if isinstance(base, np.ndarray):
            owner = base
        base = getattr(base, "base", None)
    return owner


def _root_bounds(owner: np.ndarray) -> tuple[int, int]:
    """[low, high) of the memory `owner` (a chain's root, `_root`) holds."""
    known = _OWNED_BOUNDS.get(id(owner))
    if known is not None and known[0]() is owner:
        return known[1], known[2]
    bounds = _extent(owner, owner.__array_interface__["data"][0])
    if owner.base is None and owner.flags.owndata:
        key = id(owner)
        _OWNED_BOUNDS[key] = (weakref.ref(owner, lambda _, key=key: _forget_owner(key)), *bounds)
    return bounds


def _extent(array: np.ndarray, address: int) -> tuple[int, int]:
    """[low, high) of the bytes a view of `array`'s shape and strides touches from `address`."""
    if array.flags.c_contiguous:
        return address, address + array.nbytes
    low = high = address
    for count, stride in zip(array.shape, array.strides):
        if count == 0:
            return low, low
        if stride < 0:
            low += (count - 1) * stride
        else:
            high += (count - 1) * stride
    return low, high + array.itemsize


def checked(array: object, name: str, dtype: np.dtype, shape: tuple[int, ...], *,
            writes: bool = False, strided: bool = False) -> int:
    """The address of `array` after checking it is what a kernel indexes as `name`: `dtype`,
    exactly `shape`, C order (or, with `strided`, any non-negative strides with a unit last one,
    zero for broadcast axes), writable if the kernel `writes` it, and within its owner's memory."""
    if not isinstance(array, np.ndarray):
        raise KernelCallError(f"{name}: expected a NumPy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise KernelCallError(f"{name}: dtype {array.dtype}, the kernel reads {dtype}")
    if array.shape != shape:
        raise KernelCallError(f"{name}: shape {array.shape}, the kernel indexes {shape}")
    if writes and not array.flags.writeable:
        raise KernelCallError(f"{name}: read-only, the kernel writes it")
    if strided:
        strides, itemsize = array.strides, array.itemsize
        for stride in strides:
            if stride < 0 or stride % itemsize:
                raise KernelCallError(f"{name}: strides {strides} (unit last stride, none "
                                      "negative)")
        if shape and shape[-1] > 1 and strides[-1] != itemsize:
            raise KernelCallError(f"{name}: strides {strides} (unit last stride, none negative)")
    elif not array.flags.c_contiguous:
        raise KernelCallError(f"{name}: not C-contiguous (strides {array.strides})")
    address = array.ctypes.data
    if not address and array.size:
        raise KernelCallError(f"{name}: null buffer")
    if array.base is not None:  # a view: its extent must lie within what its owner holds
        owner = _root(array)
        if owner is array:
            # The root of its chain (an array over another object's buffer, such as an MLX
            # array's host view, whose memoryview holds it): its extent is what it holds.
            return address
        low, high = _extent(array, address)
        owner_low, owner_high = _root_bounds(owner)
        if low < owner_low or high > owner_high:
            raise KernelCallError(f"{name}: its view reaches [{low:#x}, {high:#x}) outside its "
                                  f"buffer [{owner_low:#x}, {owner_high:#x})")
    return address


def _optional(array: np.ndarray | None, name: str, dtype: np.dtype,
              shape: tuple[int, ...]) -> int | None:
    return None if array is None else checked(array, name, dtype, shape)


def element_strides(array: np.ndarray) -> native.Strides4:
    itemsize = array.itemsize
    return native.Strides4(*[stride // itemsize for stride in array.strides])


def weight_layout(form: int, rows: int, cols: int) -> tuple[np.dtype, tuple[int, int]]:
    """The dtype and shape of a [rows, cols] weight as stored in `form`: its values, or for a
    GGUF form each row's blocks as bytes."""
    if form >= native.FORM_GGML:
        block = native.GGML_BLOCKS.get(form - native.FORM_GGML)
        if block is None:
            raise KernelCallError(f"weight: ggml type {form - native.FORM_GGML} is not one the "
                                  f"kernels read ({', '.join(native.GGML_TYPES)})")
        values, nbytes = block
        if cols % values:
            raise KernelCallError(f"weight: {cols} columns are not whole blocks of {values}")
        return _U8, (rows, cols // values * nbytes)
    if form not in _WEIGHT_DTYPES:
        raise KernelCallError(f"weight: unknown form {form}")
    return _WEIGHT_DTYPES[form], (rows, cols)


@dataclass(frozen=True)
class PartArgs:
    """Rows of a weight matrix in one form: values [rows, cols], or GGUF blocks [rows, bytes]."""

    weight: np.ndarray
    form: int
    scale: np.ndarray | None  # one per row for int8, else None
    rows: int


@dataclass(frozen=True)
class MatrixArgs:
    """A weight matrix [rows, cols] made of parts stacked along its rows (each in its own form:
    a GGUF may store q and k in Q5_0 and v in Q8_0), with its bias, and the struct that points
    at them: the object owns what the struct points into."""

    parts: tuple[PartArgs, ...]
    cols: int
    bias: np.ndarray | None
    struct: native.Matrix

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def nbytes(self) -> int:
        arrays = [a for part in self.parts for a in (part.weight, part.scale) if a is not None]
        return sum(a.nbytes for a in arrays) + (0 if self.bias is None else self.bias.nbytes)

    @classmethod
    def build(cls, weight: np.ndarray, form: int, scale: np.ndarray | None = None,
              bias: np.ndarray | None = None, cols: int | None = None) -> "MatrixArgs":
        """One part: `weight` [rows, cols] in `form` (for a GGUF form, [rows, bytes], and `cols`
        gives the values a row)."""
        if getattr(weight, "ndim", 0) != 2:
            raise KernelCallError(f"weight: a 2-D matrix in a kernel form, got form {form}")
        if cols is None:
            if form >= native.FORM_GGML:
                raise KernelCallError("weight: a GGUF form needs its columns given")
            cols = int(weight.shape[1])
        return cls.stack([(weight, form, scale)], cols, bias)

    @classmethod
    def stack(cls, parts: list[tuple[np.ndarray, int, np.ndarray | None]], cols: int,
              bias: np.ndarray | None = None) -> "MatrixArgs":
        """Parts (weight, form, scale) stacked along their rows, each checked against `cols`."""
        if not 1 <= len(parts) <= native.MAX_PARTS or cols < 1:
            raise KernelCallError(f"weight: 1 to {native.MAX_PARTS} parts of >= 1 column")
        checked_parts: list[PartArgs] = []
        structs = []
        for weight, form, scale in parts:
            if getattr(weight, "ndim", 0) != 2 or weight.shape[0] < 1:
                raise KernelCallError(f"weight: a 2-D matrix in a kernel form, got form {form}")
            rows = int(weight.shape[0])
            dtype, shape = weight_layout(form, rows, cols)
            if (form == native.FORM_INT8) != (scale is not None):
                raise KernelCallError("weight: int8 needs one scale per row, the other forms none")
            structs.append(native.Part(checked(weight, "weight", dtype, shape),
                                       _optional(scale, "scale", _F32, (rows,)), form, rows))
            checked_parts.append(PartArgs(weight, form, scale, rows))
        rows = sum(part.rows for part in checked_parts)
        struct = native.Matrix((native.Part * native.MAX_PARTS)(*structs), len(structs),
                               _optional(bias, "bias", _F32, (rows,)))
        return cls(tuple(checked_parts), int(cols), bias, struct)


@dataclass(frozen=True)
class LayerArgs:
    """One layer's weights for layer_pre / layer_post, checked against its shape once; the
    object owns every array its struct points into."""

    shape: native.Shape
    vectors: dict[str, np.ndarray | None]
    matrices: dict[str, MatrixArgs]
    inv_freq: np.ndarray
    struct: native.Layer

    @property
    def width(self) -> int:
        """The stacked q/k/v projection's outputs a row."""
        s = self.shape
        return int((s.heads + 2 * s.kv_heads) * s.head_dim)

    @classmethod
    def build(cls, shape: native.Shape, vectors: dict[str, np.ndarray | None],
              matrices: dict[str, MatrixArgs], inv_freq: np.ndarray) -> "LayerArgs":
        H, D, I = shape.hidden, shape.head_dim, shape.intermediate
        if min(H, D, I, shape.heads, shape.kv_heads, shape.threads) < 1 or \
                shape.heads % shape.kv_heads or not 0 <= shape.rope_dims <= D or \
                shape.rope_dims % 2 or shape.rope_dims > 1024:
            raise KernelCallError(f"layer shape: hidden {H}, heads {shape.heads}/"
                                  f"{shape.kv_heads}, head_dim {D}, rope_dims {shape.rope_dims}")
        lengths = {"input_norm": H, "q_norm": D, "k_norm": D, "post_attn_norm": H,
                   "pre_ff_norm": H, "post_ff_norm": H}
        required = ("input_norm", "pre_ff_norm")
        pointers = {}
        for name, length in lengths.items():
            vector = vectors.get(name)
            if vector is None and name in required:
                raise KernelCallError(f"{name}: required")
            pointers[name] = _optional(vector, name, _F32, (length,))
        expected = {"qkv": ((shape.heads + 2 * shape.kv_heads) * D, H),
                    "o": (H, shape.heads * D), "gate_up": (2 * I, H), "down": (H, I)}
        for name, dims in expected.items():
            matrix = matrices[name]
            if (matrix.rows, matrix.cols) != dims:
                raise KernelCallError(f"{name}: [{matrix.rows}, {matrix.cols}], the layer "
                                      f"needs {list(dims)}")
        checked(inv_freq, "inv_freq", _F32, (shape.rope_dims // 2,))
        struct = native.Layer(pointers["input_norm"], matrices["qkv"].struct,
                              pointers["q_norm"], pointers["k_norm"], matrices["o"].struct,
                              pointers["post_attn_norm"], pointers["pre_ff_norm"],
                              matrices["gate_up"].struct, matrices["down"].struct,
                              pointers["post_ff_norm"])
        return cls(shape, dict(vectors), dict(matrices), inv_freq, struct)


@dataclass(frozen=True)
class StepArgs:
    """Every layer of a backbone for step.c's decode_step, checked once: the layers (which own
    what their structs point into) and the table of pointers to them. Layers of one width
    only (heads, kv heads, head size, hidden and intermediate sizes)."""

    layers: tuple[LayerArgs, ...]
    scales: tuple[float, ...]
    table: ctypes.Array

    @classmethod
    def build(cls, layers: list[LayerArgs], scales: list[float]) -> "StepArgs":
        if not layers or len(scales) != len(layers):
            raise KernelCallError("decode step: one attention scale per layer, at least one layer")
        first = layers[0].shape
        widths = ("hidden", "heads", "kv_heads", "head_dim", "intermediate")
        for layer in layers:
            if any(getattr(layer.shape, name) != getattr(first, name) for name in widths):
                raise KernelCallError("decode step: layers of different widths")
        table = (native.StepLayer * len(layers))(*[
            native.StepLayer(ctypes.addressof(layer.struct), ctypes.addressof(layer.shape),
                             layer.inv_freq.__array_interface__["data"][0], float(scale))
            for layer, scale in zip(layers, scales)])
        return cls(tuple(layers), tuple(float(s) for s in scales), table)

    @property
    def shape(self) -> native.Shape:
        return self.layers[0].shape


@dataclass
class StepCache:
    """One block's KV cache in one layer as a step reads it: its buffers before the step (NumPy
    views of the cache's evaluated float32 arrays [1, kv_heads, slots, D]) and the `keys` keys
    the block's attention reads, its own new ones last, the others from the buffers in order of
    position from `first`, the oldest in slot `rotation` of a ring of `ring` slots (0: `keys`;
    see cpu_attention.key_layout); `mask_kind` with `mask` [1, heads, rows, keys] (any strides)
    for the array kinds."""

    keys_buffer: np.ndarray
    values_buffer: np.ndarray
    keys: int
    first: int
    rotation: int
    ring: int = 0
    mask_kind: int = native.MASK_NONE
    mask: np.ndarray | None = None


def _check_buffer_slots(from_buffer: int, rotation: int, ring: int, slots: int,
                        what: str) -> None:
    """The buffer slots a key layout reads (`from_buffer` keys from slot `rotation` of a ring of
    `ring`) lie in buffers of `slots`."""
    last = rotation + from_buffer - 1 if rotation + from_buffer - 1 < ring else ring - 1
    if from_buffer and last >= slots:
        raise KernelCallError(f"{what}: key slot {last} of buffers of {slots}")


def _status(name: str, status: int) -> None:
    if status:
        raise KernelCallError(f"{name} refused the call (status {status})")


class Kernels:
    """The compiled kernels behind checked methods (see the module's rule)."""

    def __init__(self, library: ctypes.CDLL, vector_width: int) -> None:
        self._library = library
        self.vector_width = vector_width  # float32 lanes of the build: head sizes must divide

    @property
    def uses_amx(self) -> bool:
        """Whether prefill rows' GGUF products take AMX tiles here (native.amx_in_use)."""
        return native.amx_in_use(self._library)

    def matvec(self, matrix: MatrixArgs, x: np.ndarray, out: np.ndarray,
               threads: int) -> None:
        """out [m, rows] = x [m, cols] @ weight.T (times the row scales) + bias, float32."""
        m = int(x.shape[0]) if getattr(x, "ndim", 0) == 2 else -1
        if m < 1:
            raise KernelCallError(f"x: expected [rows, {matrix.cols}] float32 rows")
        status = self._library.matrix_product(
            ctypes.byref(matrix.struct), checked(x, "x", _F32, (m, matrix.cols)),
            checked(out, "out", _F32, (m, matrix.rows), writes=True),
            matrix.rows, matrix.cols, m, max(1, threads))
        if status == -2:
            raise MemoryError("matrix kernel: no memory for the quantized activations")
        _status("matvec", status)

    def dequantize_rows(self, weight: np.ndarray, form: int, cols: int, ids: np.ndarray,
                        out: np.ndarray) -> None:
        """out [n, cols] = rows `ids` of a GGUF-form weight [rows, bytes], as float32."""
        if form < native.FORM_GGML or getattr(weight, "ndim", 0) != 2:
            raise KernelCallError("dequantize_rows: a GGUF-form weight [rows, bytes]")
        rows = int(weight.shape[0])
        dtype, shape = weight_layout(form, rows, cols)
        n = int(ids.shape[0]) if getattr(ids, "ndim", 0) == 1 else -1
        if n < 0:
            raise KernelCallError("ids: expected a 1-D int64 array")
        if n and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise KernelCallError(f"ids: outside [0, {rows})")
        _status("dequantize_rows", self._library.dequantize_rows(
            checked(weight, "weight", dtype, shape), form - native.FORM_GGML, rows, cols,
            checked(ids, "ids", _I64, (n,)), n,
            checked(out, "out", _F32, (n, cols), writes=True)))

    def layer_pre(self, layer: LayerArgs, x: np.ndarray, positions: np.ndarray,
                  qkv_out: np.ndarray, scratch: np.ndarray) -> None:
        """qkv_out [m, width] = RoPE(norms(qkv(norm(x)))) at each row's position."""
        H = layer.shape.hidden
        m = int(x.shape[0]) if getattr(x, "ndim", 0) == 2 else -1
        if m < 1:
            raise KernelCallError(f"x: expected [rows, {H}] float32 rows")
        _status("layer_pre", self._library.layer_pre(
            ctypes.byref(layer.struct), ctypes.byref(layer.shape),
            checked(x, "x", _F32, (m, H)), m,
            checked(positions, "positions", _I64, (m,)),
            layer.inv_freq.__array_interface__["data"][0],
            checked(qkv_out, "qkv_out", _F32, (m, layer.width), writes=True),
            checked(scratch, "scratch", _F32, (m, H), writes=True)))

    def layer_post(self, layer: LayerArgs, x: np.ndarray, attended: np.ndarray,
                   scratch: np.ndarray) -> None:
        """x [m, H] += the attention output's projection and the MLP, in place."""
        s = layer.shape
        m = int(x.shape[0]) if getattr(x, "ndim", 0) == 2 else -1
        if m < 1:
            raise KernelCallError(f"x: expected [rows, {s.hidden}] float32 rows")
        _status("layer_post", self._library.layer_post(
            ctypes.byref(layer.struct), ctypes.byref(layer.shape),
            checked(x, "x", _F32, (m, s.hidden), writes=True), m,
            checked(attended, "attended", _F32, (m, s.heads * s.head_dim)),
            checked(scratch, "scratch", _F32, (m, s.hidden + 3 * s.intermediate), writes=True)))

    def step_layers(self, step: StepArgs, first: int, stop: int, block_rows: list[int],
                    caches: list[StepCache], x: np.ndarray, positions: np.ndarray,
                    qkv: np.ndarray, scratch: np.ndarray, attended: np.ndarray) -> None:
        """x [m, H] through layers [first, stop) of `step` in one call, blocks of
        `block_rows` rows each attending over its own cache (`caches`, layer-major: every
        block's entry for layer `first`, then for the next layer, ...): layer_pre, each block's
        attention over its cache plus its own new keys and values, layer_post. qkv
        [stop - first, m, width] keeps each layer's projections: the new keys and values for
        the caches' updates. The same calls, in the same order, as layer_pre / attention /
        layer_post one layer at a time, so the same bits."""
        s = step.shape
        H, I, D, kv, heads = s.hidden, s.intermediate, s.head_dim, s.kv_heads, s.heads
        if not 0 <= first < stop <= len(step.layers) or not block_rows \
                or min(block_rows) < 1:
            raise KernelCallError(f"step: layers [{first}, {stop}) of {len(step.layers)}, "
                                  f"blocks of {block_rows} rows")
        n_layers, blocks = stop - first, len(block_rows)
        m = int(x.shape[0]) if getattr(x, "ndim", 0) == 2 else -1
        if m != sum(block_rows) or len(caches) != n_layers * blocks:
            raise KernelCallError(f"step: {len(caches)} caches and {m} rows for {n_layers} "
                                  f"layers of blocks of {block_rows} rows")
        if D % self.vector_width:
            raise KernelCallError(f"step: head size {D} is not whole vectors of "
                                  f"{self.vector_width}")
        width = step.layers[0].width
        table = np.zeros((len(caches), len(native.STEP_CACHE_FIELDS)), np.int64)
        for index, cache in enumerate(caches):
            rows = block_rows[index % blocks]
            keys, slots = cache.keys, -1
            if getattr(cache.keys_buffer, "ndim", 0) == 4:
                slots = int(cache.keys_buffer.shape[2])
            shape = (1, kv, slots, D)
            k = checked(cache.keys_buffer, "k", _F32, shape, strided=True)
            v = checked(cache.values_buffer, "v", _F32, shape, strided=True)
            rotation, from_buffer = cache.rotation, keys - rows
            ring = cache.ring or keys
            if (from_buffer < 0 or ring < 1 or from_buffer > ring
                    or not 0 <= rotation < ring or abs(cache.first) >= 1 << 60):
                raise KernelCallError(f"step: {keys} keys for {rows} rows, rotation {rotation} "
                                      f"of a ring of {ring}, first position {cache.first}")
            _check_buffer_slots(from_buffer, rotation, ring, slots, "step")
            mask_address, mask_strides = 0, (0, 0, 0, 0)
            if cache.mask_kind in (native.MASK_BOOL, native.MASK_ADD):
                mask_dtype = np.dtype(np.bool_) if cache.mask_kind == native.MASK_BOOL else _F32
                mask_address = checked(cache.mask, "mask", mask_dtype, (1, heads, rows, keys),
                                       strided=True)
                mask_strides = tuple(t // cache.mask.itemsize for t in cache.mask.strides)
            elif cache.mask_kind not in (native.MASK_NONE, native.MASK_CAUSAL) \
                    or cache.mask is not None:
                raise KernelCallError(f"step: mask kind {cache.mask_kind} with "
                                      f"{'a' if cache.mask is not None else 'no'} mask array")
            table[index] = (k, v, *(t // 4 for t in cache.keys_buffer.strides),
                            *(t // 4 for t in cache.values_buffer.strides), slots, keys,
                            cache.first, rotation, cache.ring, cache.mask_kind, mask_address,
                            *mask_strides)
        rows_table = np.array(block_rows, np.int64)
        status = self._library.step_layers(
            step.table, first, stop, blocks, rows_table.ctypes.data, table.ctypes.data,
            checked(x, "x", _F32, (m, H), writes=True), m,
            checked(positions, "positions", _I64, (m,)),
            checked(qkv, "qkv", _F32, (n_layers, m, width), writes=True),
            checked(scratch, "scratch", _F32, (m, H + 3 * I), writes=True),
            checked(attended, "attended", _F32, (m, heads * D), writes=True))
        if status == -2:
            raise MemoryError("step: no memory for a kernel's scratch")
        _status("step_layers", status)

    def rows_rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float,
                      out: np.ndarray) -> None:
        m, n = x.shape if getattr(x, "ndim", 0) == 2 else (-1, -1)
        if m < 1:
            raise KernelCallError("x: expected [rows, n] float32 rows")
        _status("rows_rms_norm", self._library.rows_rms_norm(
            checked(x, "x", _F32, (m, n)), checked(weight, "weight", _F32, (n,)), eps, m, n,
            checked(out, "out", _F32, (m, n), writes=True)))

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_form: int,
                  mask: np.ndarray | None, mask_kind: int, out: np.ndarray, scale: float,
                  threads: int, layout: tuple[np.ndarray, np.ndarray] | None = None,
                  tail: tuple[np.ndarray, np.ndarray] | None = None,
                  keys: int | None = None) -> bool:
        """out [B, heads, L, D] = softmax(scale q k^T + mask) v; q, out float32 and k, v
        [B, kv_heads, S, D] in `kv_form`, each with any strides whose last is one. `layout`:
        per batch row, the absolute position of its oldest key and that key's buffer index
        (int64 [B] each; see cpu_attention.key_layout), or None for keys in order from 0.
        `tail`: the last keys and values [B, kv_heads, n, D], read from these arrays instead
        of k and v, which then hold `keys` - n of the `keys` keys (the mask's last axis) in
        buffers of any length. False where the kernel does not take the shapes (e.g. a head
        size its vectors do not divide)."""
        if getattr(q, "ndim", 0) != 4 or getattr(k, "ndim", 0) != 4:
            raise KernelCallError("attention: q and k must be [B, heads, L, D] arrays")
        batch, heads, length, dim = q.shape
        kv_heads, slots = k.shape[1], k.shape[2]
        total = slots if keys is None else keys
        if min(batch, heads, length, dim, kv_heads, total) < 1 or heads % kv_heads:
            raise KernelCallError(f"attention: q {q.shape} against k {k.shape}")
        if dim % self.vector_width or kv_form not in _KV_DTYPES:
            return False
        kv_dtype = _KV_DTYPES[kv_form]
        if mask_kind in (native.MASK_NONE, native.MASK_CAUSAL):
            if mask is not None:
                raise KernelCallError("attention: a mask array with a mask kind that reads none")
            mask_pointer, mask_strides = None, native.Strides4(0, 0, 0, 0)
        elif mask_kind in (native.MASK_BOOL, native.MASK_ADD):
            mask_dtype = np.dtype(np.bool_) if mask_kind == native.MASK_BOOL else _F32
            mask_pointer = checked(mask, "mask", mask_dtype, (batch, heads, length, total),
                                   strided=True)
            mask_strides = element_strides(mask)
        else:
            raise KernelCallError(f"attention: unknown mask kind {mask_kind}")
        args = native.Attention(
            q=checked(q, "q", _F32, (batch, heads, length, dim), strided=True),
            k=checked(k, "k", kv_dtype, (batch, kv_heads, slots, dim), strided=True),
            v=checked(v, "v", kv_dtype, (batch, kv_heads, slots, dim), strided=True),
            qs=element_strides(q), ks=element_strides(k), vs=element_strides(v),
            mask=mask_pointer, ms=mask_strides, mask_kind=mask_kind,
            out=checked(out, "out", _F32, (batch, heads, length, dim), writes=True,
                        strided=True),
            os=element_strides(out), B=batch, heads=heads, kv_heads=kv_heads, L=length,
            S=total, D=dim, scale=float(scale), kv_form=kv_form, threads=max(1, threads),
            S_buf=slots)
        rotations = [0] * batch
        if layout is not None:
            first, rotation = layout
            args.kpos = checked(first, "key positions", _I64, (batch,))
            args.krot = checked(rotation, "key rotation", _I64, (batch,))
            rotations, firsts = rotation.tolist(), first.tolist()  # B ints: no NumPy reductions
            if (min(rotations) < 0 or max(rotations) >= total
                    or max(abs(position) for position in firsts) >= 1 << 60):
                raise KernelCallError(f"attention: key rotation {rotation} outside [0, {total}) "
                                      f"or positions {first} out of range")
        tail_length = 0
        if tail is not None:
            tail_keys, tail_values = tail
            tail_length = int(tail_keys.shape[2]) if getattr(tail_keys, "ndim", 0) == 4 else -1
            if not 0 < tail_length <= total:
                raise KernelCallError(f"attention: a tail of {tail_length} keys of {total}")
            shape = (batch, kv_heads, tail_length, dim)
            args.tk = checked(tail_keys, "tail keys", kv_dtype, shape, strided=True)
            args.tv = checked(tail_values, "tail values", kv_dtype, shape, strided=True)
            args.ts, args.tvs = element_strides(tail_keys), element_strides(tail_values)
            args.tail = tail_length
        elif total != slots:
            raise KernelCallError(f"attention: {total} keys in buffers of {slots} without a tail")
        for rotation in rotations:  # the buffer slots the kernel reads lie in k and v
            _check_buffer_slots(total - tail_length, rotation, total, slots, "attention")
        status = self._library.attention(ctypes.byref(args))
        if status == -2:
            raise MemoryError("attention kernel: no memory for its scratch")
        return status == 0

    def gated_delta(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                    beta: np.ndarray, mask: np.ndarray | None, state: np.ndarray,
                    y: np.ndarray, threads: int) -> None:
        """The gated delta recurrence over T steps: y written, state updated in place."""
        if getattr(q, "ndim", 0) != 4 or getattr(v, "ndim", 0) != 4:
            raise KernelCallError("gated_delta: q [B, T, Hk, Dk] and v [B, T, Hv, Dv]")
        batch, steps, key_heads, key_dim = q.shape
        value_heads, value_dim = v.shape[2], v.shape[3]
        if min(batch, steps, key_heads, key_dim, value_heads, value_dim) < 1 or \
                value_heads % key_heads:
            raise KernelCallError(f"gated_delta: {value_heads} value heads do not group over "
                                  f"{key_heads} key heads")
        per_key = getattr(g, "ndim", 0) == 4
        g_shape = (batch, steps, value_heads) + ((key_dim,) if per_key else ())
        args = native.GatedDelta(
            q=checked(q, "q", _F32, (batch, steps, key_heads, key_dim)),
            k=checked(k, "k", _F32, (batch, steps, key_heads, key_dim)),
            v=checked(v, "v", _F32, (batch, steps, value_heads, value_dim)),
            g=checked(g, "g", _F32, g_shape),
            beta=checked(beta, "beta", _F32, (batch, steps, value_heads)),
            mask=_optional(mask, "mask", _U8, (batch, steps)),
            state=checked(state, "state", _F32, (batch, value_heads, value_dim, key_dim),
                          writes=True),
            y=checked(y, "y", _F32, (batch, steps, value_heads, value_dim), writes=True),
            B=batch, T=steps, Hk=key_heads, Hv=value_heads, Dk=key_dim, Dv=value_dim,
            g_per_key=int(per_key), threads=max(1, threads))
        _status("gated_delta", self._library.gated_delta(ctypes.byref(args)))


_checked_kernels: Kernels | None = None


def kernels() -> Kernels | None:
    """The checked kernels for this CPU (built on first use), or None where they cannot be."""
    global _checked_kernels
    if _checked_kernels is None:
        library = native.load_kernels()
        if library is None:
            return None
        _checked_kernels = Kernels(library, native.vector_width())
    return _checked_kernels


def kernels_for(isa: str) -> Kernels | None:
    """The checked kernels of one build (native.ISAS), whatever this process uses; None where
    this CPU does not run it. For comparing the builds with each other."""
    library = native.load_isa(isa)
    return None if library is None else Kernels(library, native.isa_vector_width(isa))
