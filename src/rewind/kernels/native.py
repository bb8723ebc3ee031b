"""Build and load rewind/kernels/c/*.c: the CPU kernels (matvecs, layer work, attention, the
gated delta rule).

Compiled once with the system C compiler into the cache folder, keyed by the source and the
flags (AVX-512 where /proc/cpuinfo shows it, else AVX2 + FMA; REWIND_SANITIZE adds a
sanitizer's instrumentation), and loaded with ctypes. Only rewind.kernels.boundary calls them. `load_kernels()` returns None where that cannot happen (not x86-64 with AVX2, no
compiler, a failed build): callers then keep MLX's path, which gives the same answers slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rewind import env
from rewind.paths import cache_home

log = logging.getLogger(__name__)

NATIVE = Path(__file__).resolve().parent / "c"  # the C sources, beside this package
SOURCES = (NATIVE / "pool.c", NATIVE / "cpu_kernels.c", NATIVE / "quant.c", NATIVE / "attention.c",
           NATIVE / "gated_delta.c", NATIVE / "step.c")
HEADERS = (NATIVE / "simd.h", NATIVE / "quant.h", NATIVE / "quant512.h",
           NATIVE / "layer.h", NATIVE / "attention.h")
_BASE_FLAGS = ["-O3", "-pthread", "-shared", "-fPIC", "-ffp-contract=off"]
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_AVX512_FLAGS = [*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_VNNI_FLAGS = [*_AVX512_FLAGS, "-mavx512vnni"]

FORM_F32, FORM_BF16, FORM_INT8 = 0, 1, 2
FORMS = {"f32": FORM_F32, "bf16": FORM_BF16, "int8": FORM_INT8}
# GGUF blocks read in place: the form is FORM_GGML + the ggml type (quant.h).
FORM_GGML = 100
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
              "Q6_K": 14}
GGML_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144),
               13: (256, 176), 14: (256, 210)}  # type -> (values, bytes) of one block
ACT_GELU_TANH, ACT_SILU = 0, 1

_kernels: ctypes.CDLL | None = None
_tried = False


class Part(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("form", ctypes.c_int64), ("rows", ctypes.c_int64)]


MAX_PARTS = 3


class Matrix(ctypes.Structure):
    _fields_ = [("parts", Part * MAX_PARTS), ("count", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("qkv", Matrix), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("o", Matrix), ("post_attn_norm", ctypes.c_void_p),
                ("pre_ff_norm", ctypes.c_void_p), ("gate_up", Matrix), ("down", Matrix),
                ("post_ff_norm", ctypes.c_void_p)]


class Strides4(ctypes.Array):
    _type_ = ctypes.c_int64
    _length_ = 4


class Attention(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("qs", Strides4), ("ks", Strides4), ("vs", Strides4),
                ("mask", ctypes.c_void_p), ("ms", Strides4), ("mask_kind", ctypes.c_int64),
                ("out", ctypes.c_void_p), ("os", Strides4),
                ("B", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("L", ctypes.c_int64), ("S", ctypes.c_int64), ("D", ctypes.c_int64),
                ("scale", ctypes.c_float), ("kv_form", ctypes.c_int64),
                ("threads", ctypes.c_int64),
                ("kpos", ctypes.c_void_p), ("krot", ctypes.c_void_p),
                ("tail", ctypes.c_int64), ("S_buf", ctypes.c_int64),
                ("tk", ctypes.c_void_p), ("tv", ctypes.c_void_p),
                ("ts", Strides4), ("tvs", Strides4), ("ring", ctypes.c_int64)]


MASK_NONE, MASK_CAUSAL, MASK_BOOL, MASK_ADD = 0, 1, 2, 3

# step.c's StepCache, as a row of int64 (addresses included): the boundary fills a NumPy table
# of them, one row per cache a step reads.
STEP_CACHE_FIELDS = ("k", "v", "ks0", "ks1", "ks2", "ks3", "vs0", "vs1", "vs2", "vs3",
                     "S_buf", "S", "kpos", "krot", "ring", "mask_kind", "mask",
                     "ms0", "ms1", "ms2", "ms3")


class StepLayer(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_void_p), ("shape", ctypes.c_void_p),
                ("inv_freq", ctypes.c_void_p), ("scale", ctypes.c_float)]


class GatedDelta(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("g", ctypes.c_void_p), ("beta", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("state", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("B", ctypes.c_int64), ("T", ctypes.c_int64), ("Hk", ctypes.c_int64),
                ("Hv", ctypes.c_int64), ("Dk", ctypes.c_int64), ("Dv", ctypes.c_int64),
                ("g_per_key", ctypes.c_int64), ("threads", ctypes.c_int64)]


class Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("rope_dims", ctypes.c_int64),
                ("activation", ctypes.c_int64), ("threads", ctypes.c_int64),
                ("eps", ctypes.c_float), ("rope_scale", ctypes.c_float),
                ("traditional", ctypes.c_int64)]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# The instruction sets the kernels are built for: simd.h's AVX2 and AVX-512 paths, and AVX-512
# with VNNI, whose vpdpbusd does quant.c's int8 products in one instruction instead of two.
ISAS = ("avx2", "avx512", "avx512vnni")
_AVX512_CPU = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
_ISA_CPU_FLAGS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": _AVX512_CPU,
                  "avx512vnni": _AVX512_CPU | {"avx512_vnni"}}
_ISA_COMPILE_FLAGS = {"avx2": _AVX2_FLAGS, "avx512": _AVX512_FLAGS, "avx512vnni": _VNNI_FLAGS}
_SANITIZER_FLAGS = {"address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                                "-fno-omit-frame-pointer", "-g"],
                    "thread": ["-fsanitize=thread", "-fno-omit-frame-pointer", "-g"]}


def runnable_isas() -> tuple[str, ...]:
    """The kernel builds this CPU runs (none off x86-64 or without AVX2/FMA/F16C)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags = _cpu_flags()
    return tuple(isa for isa in ISAS if _ISA_CPU_FLAGS[isa] <= flags)


def chosen_isa() -> str | None:
    """The build the kernels use here: REWIND_KERNEL_ISA's, else the widest this CPU runs
    (AVX-512 with VNNI, AVX-512, AVX2), AVX2 where REWIND_NO_AVX512 is 1; None where none
    runs."""
    isas = runnable_isas()
    if not isas:
        return None
    asked = env.kernel_isa()
    if asked is not None:
        if asked not in isas:
            raise env.EnvError(f"REWIND_KERNEL_ISA={asked}: this CPU runs only "
                               f"{', '.join(isas)}")
        return asked
    return "avx2" if env.no_avx512() else isas[-1]


def compile_flags(isa: str | None = None) -> list[str] | None:
    """The compiler flags for `isa` (default: `chosen_isa()`), with REWIND_SANITIZE's
    instrumentation; None where the kernels cannot run here."""
    isa = isa or chosen_isa()
    if isa is None or isa not in runnable_isas():
        return None
    sanitizer = env.sanitize()
    return [*_BASE_FLAGS, *_ISA_COMPILE_FLAGS[isa],
            *(_SANITIZER_FLAGS[sanitizer] if sanitizer else [])]


@functools.lru_cache(maxsize=1)
def vector_width() -> int:
    """float32 lanes per vector in the kernels built for this CPU (16 with AVX-512, else 8)."""
    return isa_vector_width(chosen_isa() or "avx2")


def isa_vector_width(isa: str) -> int:
    return 16 if isa.startswith("avx512") else 8


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.matrix_product.argtypes = [ctypes.POINTER(Matrix), p, p, i64, i64, i64, ctypes.c_int]
    lib.dequantize_rows.argtypes = [p, ctypes.c_int, i64, i64, p, i64, p]
    lib.layer_pre.argtypes = [ctypes.POINTER(Layer), ctypes.POINTER(Shape), p, i64, p, p, p, p]
    lib.layer_post.argtypes = [ctypes.POINTER(Layer), ctypes.POINTER(Shape), p, i64, p, p]
    lib.rows_rms_norm.argtypes = [p, p, ctypes.c_float, i64, i64, p]
    lib.attention.argtypes = [ctypes.POINTER(Attention)]
    lib.gated_delta.argtypes = [ctypes.POINTER(GatedDelta)]
    lib.quant_amx.argtypes = [ctypes.c_int]
    lib.quant_strips_above.argtypes = [ctypes.c_int]
    lib.quant_amx_rule.argtypes = [ctypes.c_int]
    lib.step_layers.argtypes = [ctypes.POINTER(StepLayer), i64, i64, i64, p, p, p, i64, p, p,
                                p, p]
    for name in ("quant_amx", "quant_strips_above", "quant_amx_rule", "matrix_product", "dequantize_rows", "layer_pre", "layer_post",
                 "rows_rms_norm", "attention", "gated_delta", "step_layers"):
        getattr(lib, name).restype = ctypes.c_int


def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU (built on first use), or None where they cannot be
    built here."""
    global _kernels, _tried
    if _tried:
        return _kernels
    _tried = True
    isa = chosen_isa()
    _kernels = None if isa is None else load_isa(isa)
    return _kernels


def c_compiler() -> str | None:
    """The system C compiler the kernels are built with ($CC, else cc, else gcc)."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.lru_cache(maxsize=None)
def load_isa(isa: str) -> ctypes.CDLL | None:
    """The kernels built for `isa` (one of ISAS), or None where this CPU does not run it or they
    cannot be built. Each build is its own library, so a test can load both and compare."""
    flags = compile_flags(isa)
    compiler = c_compiler()
    if flags is None or compiler is None or not all(p.exists() for p in SOURCES + HEADERS):
        log.info("native CPU kernels unavailable (need x86-64 AVX2/FMA and a C compiler)")
        return None
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    tag = hashlib.blake2b(source + " ".join(flags).encode(), digest_size=8).hexdigest()
    library = cache_home() / "native" / f"cpu_kernels-{isa}-{tag}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            built = Path(scratch) / library.name
            try:
                result = subprocess.run([compiler, *flags, "-o", str(built),
                                         *map(str, SOURCES), "-lm"],
                                        capture_output=True, text=True, timeout=180)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("native CPU kernels: could not run %s: %s", compiler, exc)
                return None
            if result.returncode != 0:
                log.warning("native CPU kernels: compiling %s failed: %s", NATIVE,
                            result.stderr[-800:])
                return None
            os.replace(built, library)  # atomic: a reader never sees half a library
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        log.warning("native CPU kernels: loading %s failed: %s", library, exc)
        return None
    _declare(lib)
    lib.quant_amx(0 if env.no_amx() else 1)
    return lib


def amx_in_use(lib: ctypes.CDLL) -> bool:
    """Whether `lib`'s prefill products use AMX tiles (AVX512-VNNI build, an AMX-INT8 CPU,
    Linux's permission, and REWIND_NO_AMX unset)."""
    return bool(lib.quant_amx(-1))


def kernels_summary() -> str | None:
    """The kernel build this process would use and whether its prefill products would take
    AMX tiles (from the CPU's flags and REWIND_NO_AMX, without loading anything), for reports;
    None where no build runs here."""
    isa = chosen_isa()
    if isa is None:
        return None
    amx = isa == "avx512vnni" and "amx_int8" in _cpu_flags() and not env.no_amx()
    return f"{isa}, AMX {'on' if amx else 'off'}"


def set_amx(lib: ctypes.CDLL, wanted: bool) -> bool:
    """Turns `lib`'s AMX products on or off (they give the same bits either way); returns
    whether they are on."""
    return bool(lib.quant_amx(int(wanted)))


AMX_RULES = {"measured": 0, "all": 1, "none": 2}  # quant.c's quant_amx_rule


def set_amx_rule(lib: ctypes.CDLL, rule: str) -> None:
    """Which GGUF products take AMX tiles where AMX is on: "measured" (k-quants from 16
    activation rows, the default), "all" strips, "none". The same bits either way; for
    measuring (benchmarks/probes/strips_rule.py)."""
    lib.quant_amx_rule(AMX_RULES[rule])


STRIPS_ABOVE_DEFAULT = 6  # quant.c's STRIPS_ABOVE_DEFAULT


def set_strips_above(lib: ctypes.CDLL, rows: int) -> None:
    """The activation rows above which AVX512-VNNI GGUF products take strips (4 and up;
    STRIPS_ABOVE_DEFAULT unless set; at or below, the stored blocks). The same bits either way;
    for measuring."""
    lib.quant_strips_above(max(4, int(rows)))


def int8_rows(weight: Any, chunk_rows: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one float32 scale per output row (the kernels' FORM_INT8) of an MLX
    weight [out, in], a chunk of rows at a time: a 262k-word head is never widened to float32
    whole (671 MB for Gemma 3 270M)."""
    import mlx.core as mx

    rows = weight.shape[0]
    quantized = np.empty(weight.shape, np.int8)
    scales = np.empty(rows, np.float32)
    for start in range(0, rows, chunk_rows):
        part = weight[start:start + chunk_rows].astype(mx.float32)
        scale = mx.maximum(mx.abs(part).max(axis=1), 1e-12) / 127.0
        quantized[start:start + chunk_rows] = np.array(
            mx.clip(mx.round(part / scale[:, None]), -127, 127).astype(mx.int8))
        scales[start:start + chunk_rows] = np.array(scale)
    return quantized, scales


_CORES = os.cpu_count() or 1  # read once: os.cpu_count() costs ~20 us, and this runs per layer


def kernel_threads() -> int:
    """One thread per core, the count the CLI gives OpenBLAS (OPENBLAS_NUM_THREADS wins)."""
    value = os.environ.get("OPENBLAS_NUM_THREADS") or ""
    return int(value) if value.isdigit() and int(value) > 0 else _CORES
