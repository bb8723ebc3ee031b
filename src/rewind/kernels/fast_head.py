"""A cheaper output projection for CPU decode: the head's weights in bf16 (or int8) read by a
small C kernel (rewind/kernels/c/cpu_kernels.c) instead of MLX's float32 matmul.

Why: on a CPU, decode is bound by memory bandwidth. Gemma 3 270M's tied 262,144 x 640 output
projection is 671 MB in float32, read once per generated token: more than the 18 layers
together. MLX's CPU backend has no fast kernel for bf16 or quantized matmuls (both run slower
than float32 through OpenBLAS), so Rewind compiles its own kernels with the system C compiler
at first use (rewind.kernels.native) and calls them through ctypes. The bf16 form is exact for bf16 checkpoints
(the float32 weights were widened from bf16), so logits match the float32 head up to summation
order; int8 (one scale per row) halves the bytes again at a small, measured perplexity cost.
Without a compiler or AVX2 `build_kernel` returns None and the model keeps its MLX head.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import numpy as np

from rewind.kernels.object_table import ObjectTable

from rewind.kernels.boundary import Kernels, MatrixArgs, kernels
from rewind.kernels.model_split import split_model
from rewind.kernels.native import FORMS, int8_rows, kernel_threads
from rewind.kernels.host_view import host_view
from rewind.kernels.stored import StoredMatrix, StoredWeights, kernel_form

HeadForm = Literal["bf16", "int8", "gguf"]
HEAD_FORMS: tuple[str, ...] = ("bf16", "int8", "gguf")


def build_kernel() -> Kernels | None:
    """The compiled CPU kernels behind their checked boundary, or None where they cannot be
    built."""
    return kernels()


class CpuHead:
    """logits = hidden @ weight.T with `weight` [vocab, dim] kept as bf16 or int8 in host memory.

    Calling it evaluates `hidden` (a graph break: the C kernel runs outside MLX) and returns a
    materialized float32 mx.array of logits.
    """

    def __init__(self, weight: mx.array, form: HeadForm, kernel: Kernels,
                 threads: int | None = None) -> None:
        self.form = form
        self.vocab, self.dim = weight.shape
        self.threads = threads or kernel_threads()
        self._kernel = kernel
        self._row_scale: np.ndarray | None = None
        self.in_place = False  # True: reads the model's own array (no bytes of its own)
        if form == "bf16" and weight.dtype == mx.bfloat16:
            # The model's own table (the tied embedding), read in place: held once.
            self._weight = np.ascontiguousarray(host_view(weight))
            self.in_place = True
        elif form == "bf16":
            self._weight = _bf16_rows(weight)
        elif form == "int8":
            # One scale per row: each vocabulary row is one output, so the scale costs 4 bytes
            # per `dim` weights and keeps the kernel's inner loop scale-free.
            self._weight, self._row_scale = int8_rows(weight)
        else:
            raise ValueError(f"unknown head form {form!r}; expected one of {HEAD_FORMS}")
        self._matrix = MatrixArgs.build(self._weight, FORMS[form], self._row_scale)

    @classmethod
    def from_stored(cls, table: StoredMatrix, kernel: Kernels, shared: bool,
                    threads: int | None = None) -> "CpuHead":
        """The head over a stored table (a GGUF's output or tied embedding), read in place;
        `shared`: the table is the embedding the native forward already counts."""
        head = cls.__new__(cls)
        head.form, head.vocab, head.dim = "gguf", table.rows, table.cols
        head.threads = threads or kernel_threads()
        head._kernel, head._row_scale, head.in_place = kernel, None, shared
        head._weight = table.data
        head._matrix = MatrixArgs.build(table.data, kernel_form(table.ggml_type), cols=table.cols)
        return head

    @property
    def own_bytes(self) -> int:
        """Bytes this head holds beside the model's arrays (the memory budget counts them)."""
        return 0 if self.in_place else self.nbytes

    @property
    def nbytes(self) -> int:
        return self._weight.nbytes + (0 if self._row_scale is None else self._row_scale.nbytes)

    def __call__(self, hidden: mx.array) -> mx.array:
        lead = hidden.shape[:-1]
        rows = np.array(hidden.reshape(-1, self.dim).astype(mx.float32))
        return mx.array(self.logits(rows)).reshape(*lead, self.vocab)

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """float32 rows [m, dim] -> logits [m, vocab] as a NumPy array."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        out = np.empty((rows.shape[0], self.vocab), dtype=np.float32)
        self._kernel.matvec(self._matrix, rows, out, self.threads)
        return out


def head_weight(model: Any) -> mx.array | None:
    """The output projection's float weight [vocab, dim] of a model with a known split, or None
    (quantized heads and unknown families keep their own head)."""
    split = split_model(model)
    if split is None:
        return None
    owner = getattr(split.head, "__self__", split.head)  # Embedding.as_linear or the lm_head Linear
    weight = getattr(owner, "weight", None)
    if weight is None or "scales" in owner or not mx.issubdtype(weight.dtype, mx.floating):
        return None
    return weight


# Rows converted at a time: whole-table conversions of Gemma 3's 262k x 640 float32 head held a
# 671 MB float32 round trip plus a 335 MB bf16 copy at once, a load's largest transient
# (measured +0.63 GiB peak RSS); 16k rows keep it to ~40 MB.
ROW_CHUNK = 16384


def bf16_is_exact(weight: mx.array) -> bool:
    """True when every weight survives a round trip through bf16 (a bf16 checkpoint widened to
    float32): the bf16 head then computes the same products as the float32 one."""
    if weight.dtype == mx.bfloat16:
        return True
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = weight[start:start + ROW_CHUNK]
        if not mx.array_equal(rows, rows.astype(mx.bfloat16).astype(rows.dtype)).item():
            return False
    return True


def _bf16_rows(weight: mx.array) -> np.ndarray:
    """weight as bf16 bits (uint16) in host memory, converted a chunk of rows at a time."""
    out = np.empty(weight.shape, dtype=np.uint16)
    for start in range(0, weight.shape[0], ROW_CHUNK):
        chunk = weight[start:start + ROW_CHUNK].astype(mx.bfloat16).view(mx.uint16)
        out[start:start + ROW_CHUNK] = np.array(chunk)
    return out


def install_fast_head(model: Any, form: str = "auto",
                      stored: StoredWeights | None = None) -> CpuHead | None:
    """Give `model` a CpuHead used by rewind.engine.forward.last_logits; None when the kernel or a
    float head is not available (the model then keeps its MLX head).

    form "auto" installs the bf16 head only where it is exact (bf16-representable weights, as in
    the default model's bf16 checkpoint), so the answer never changes silently; "bf16" and
    "int8" install that form whatever the weights.
    """
    kernel = build_kernel()
    if stored is not None:
        if kernel is None:
            return None
        own = stored.matrices.get("lm_head")
        table = own or stored.matrices["model.embed_tokens"]
        head = CpuHead.from_stored(table, kernel, shared=own is None)
        _HEADS.set(model, head)
        return head
    weight = head_weight(model) if kernel is not None else None
    if kernel is None or weight is None:
        return None
    if form == "auto":
        if not bf16_is_exact(weight):
            return None
        form = "bf16"
    head = CpuHead(weight, form, kernel)  # type: ignore[arg-type]
    _HEADS.set(model, head)
    return head


# model -> its CpuHead: the backend's table, not an attribute on mlx-lm's object.
_HEADS: ObjectTable[CpuHead] = ObjectTable()


def fast_head(model: Any) -> CpuHead | None:
    return _HEADS.get(model)


def remove_fast_head(model: Any) -> None:
    _HEADS.pop(model)
