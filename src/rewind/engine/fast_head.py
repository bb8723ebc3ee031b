"""A cheaper output projection for CPU decode: the head's weights in bf16 (or int8) read by a
small C kernel (rewind/native/head_matvec.c) instead of MLX's float32 matmul.

Why: on a CPU, decode is bound by memory bandwidth. Gemma 3 270M's tied 262,144 x 640 output
projection is 671 MB in float32, read once per generated token: more than the 18 layers
together. MLX's CPU backend has no fast kernel for bf16 or quantized matmuls (both run slower
than float32 through OpenBLAS), so Rewind compiles a 100-line AVX2 kernel with the system C
compiler at first use and calls it through ctypes. The bf16 form is exact for bf16 checkpoints
(the float32 weights were widened from bf16), so logits match the float32 head up to summation
order; int8 (one scale per row) halves the bytes again at a small, measured perplexity cost.
Without a compiler or AVX2 `build_kernel` returns None and the model keeps its MLX head.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from rewind.paths import cache_home

log = logging.getLogger(__name__)

HeadForm = Literal["bf16", "int8"]
HEAD_FORMS: tuple[str, ...] = ("bf16", "int8")
_SOURCE = Path(__file__).resolve().parent.parent / "native" / "head_matvec.c"
_MAX_ROWS = 8  # rows of x per kernel call (MAX_ROWS in the C source)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-pthread"]

_kernel: ctypes.CDLL | None = None
_kernel_tried = False


def _cpu_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def build_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built once into the cache folder, keyed by source and flags), or None
    where it cannot be built here: not x86-64 with AVX2, or no C compiler."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    _kernel_tried = True
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not _cpu_has_avx2() or compiler is None or not _SOURCE.exists():
        log.info("fast CPU head unavailable (needs x86-64 AVX2 and a C compiler)")
        return None
    source = _SOURCE.read_bytes()
    tag = hashlib.blake2b(source + " ".join(_FLAGS).encode(), digest_size=8).hexdigest()
    library = cache_home() / "native" / f"head_matvec-{tag}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            result = subprocess.run([compiler, *_FLAGS, "-o", str(built), str(_SOURCE)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                log.warning("fast CPU head: compiling %s failed: %s", _SOURCE, result.stderr[-500:])
                return None
            os.replace(built, library)  # atomic: a reader never sees half a library
    kernel = ctypes.CDLL(str(library))
    kernel.head_matvec.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int]
    kernel.head_matvec.restype = ctypes.c_int
    _kernel = kernel
    return kernel


def kernel_threads() -> int:
    """One thread per core: the same count the CLI gives OpenBLAS."""
    value = os.environ.get("OPENBLAS_NUM_THREADS") or ""
    return int(value) if value.isdigit() and int(value) > 0 else (os.cpu_count() or 1)


class CpuHead:
    """logits = hidden @ weight.T with `weight` [vocab, dim] kept as bf16 or int8 in host memory.

    Calling it evaluates `hidden` (a graph break: the C kernel runs outside MLX) and returns a
    materialized float32 mx.array of logits.
    """

    def __init__(self, weight: mx.array, form: HeadForm, kernel: ctypes.CDLL,
                 threads: int | None = None) -> None:
        self.form = form
        self.vocab, self.dim = weight.shape
        self.threads = threads or kernel_threads()
        self._kernel = kernel
        self._row_scale: np.ndarray | None = None
        if form == "bf16":
            self._weight = np.ascontiguousarray(np.array(weight.astype(mx.bfloat16).view(mx.uint16)))
        elif form == "int8":
            weight32 = weight.astype(mx.float32)
            # Symmetric per-row scale: each vocabulary row is one output, so one scale per row
            # costs 4 bytes per 640 weights and keeps the kernel's inner loop scale-free.
            scale = mx.maximum(mx.abs(weight32).max(axis=1), 1e-12) / 127.0
            quantized = mx.clip(mx.round(weight32 / scale[:, None]), -127, 127).astype(mx.int8)
            self._weight = np.ascontiguousarray(np.array(quantized))
            self._row_scale = np.ascontiguousarray(np.array(scale), dtype=np.float32)
        else:
            raise ValueError(f"unknown head form {form!r}; expected one of {HEAD_FORMS}")

    @property
    def nbytes(self) -> int:
        return self._weight.nbytes + (0 if self._row_scale is None else self._row_scale.nbytes)

    def __call__(self, hidden: mx.array) -> mx.array:
        lead = hidden.shape[:-1]
        rows = np.ascontiguousarray(np.array(hidden.reshape(-1, self.dim).astype(mx.float32)))
        out = np.empty((rows.shape[0], self.vocab), dtype=np.float32)
        scale_ptr = None if self._row_scale is None else self._row_scale.ctypes.data
        for start in range(0, rows.shape[0], _MAX_ROWS):
            block = rows[start:start + _MAX_ROWS]
            status = self._kernel.head_matvec(
                self._weight.ctypes.data, scale_ptr, int(self.form == "int8"), block.ctypes.data,
                out[start:].ctypes.data, self.vocab, self.dim, block.shape[0], self.threads)
            if status != 0:
                raise RuntimeError(f"head_matvec failed with status {status}")
        return mx.array(out).reshape(*lead, self.vocab)


def head_weight(model: Any) -> mx.array | None:
    """The output projection's float weight [vocab, dim] of a model with a known split, or None
    (quantized heads and unknown families keep their own head)."""
    from rewind.engine.forward import split_model

    split = split_model(model)
    if split is None:
        return None
    owner = getattr(split.head, "__self__", split.head)  # Embedding.as_linear or the lm_head Linear
    weight = getattr(owner, "weight", None)
    if weight is None or "scales" in owner or not mx.issubdtype(weight.dtype, mx.floating):
        return None
    return weight


def bf16_is_exact(weight: mx.array) -> bool:
    """True when every weight survives a round trip through bf16 (a bf16 checkpoint widened to
    float32): the bf16 head then computes the same products as the float32 one."""
    if weight.dtype == mx.bfloat16:
        return True
    return bool(mx.array_equal(weight, weight.astype(mx.bfloat16).astype(weight.dtype)).item())


def install_fast_head(model: Any, form: str = "auto") -> CpuHead | None:
    """Give `model` a CpuHead used by rewind.engine.forward.last_logits; None when the kernel or a
    float head is not available (the model then keeps its MLX head).

    form "auto" installs the bf16 head only where it is exact (bf16-representable weights, as in
    the default model's bf16 checkpoint), so the answer never changes silently; "bf16" and
    "int8" install that form whatever the weights.
    """
    kernel = build_kernel()
    weight = head_weight(model) if kernel is not None else None
    if kernel is None or weight is None:
        return None
    if form == "auto":
        if not bf16_is_exact(weight):
            return None
        form = "bf16"
    head = CpuHead(weight, form, kernel)  # type: ignore[arg-type]
    # Stored outside the parameter tree (nn.Module keeps public attributes as children).
    object.__setattr__(model, "_rewind_fast_head", head)
    return head


def fast_head(model: Any) -> CpuHead | None:
    return model.__dict__.get("_rewind_fast_head")


def remove_fast_head(model: Any) -> None:
    model.__dict__.pop("_rewind_fast_head", None)
