"""Every REWIND_* environment variable, declared once (name, meaning, the values it takes) and
read here only: no other module reads os.environ for a REWIND_* name.

Why one place: the switches were read in seven modules, each with its own idea of a bad value;
some raised, most ignored a typo (REWIND_CPU_ATTENTION=0 left the kernel on). Here a value outside
a variable's choices raises EnvError (a ValueError) naming the variable and its choices, and the
CLI runs `check_all()` first, so a typo stops `rewind` before a model loads.

Values are read at each call, never cached: tests and benchmarks set some within a process (e.g.
REWIND_CPU_ATTENTION=off, to measure mlx-lm's own attention; see `overridden`). An empty value
counts as unset, as it did everywhere before. This module imports nothing heavy: the CLI and
rewind.blas use it before MLX loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rewind.forms import QuantSpec


class EnvError(ValueError):
    """A REWIND_* variable holds a value it does not take."""


@dataclass(frozen=True)
class Var:
    name: str
    help: str
    choices: tuple[str, ...] = ()  # empty: any non-empty value
    # A check for free-form values, e.g. a model form's spelling; raises ValueError.
    check: Callable[[str], None] | None = None

    def raw(self) -> str | None:
        return os.environ.get(self.name) or None

    def get(self) -> str | None:
        """The value, or None when unset or empty; EnvError when it is not one it takes."""
        value = self.raw()
        if value is None:
            return None
        if self.choices and value not in self.choices:
            raise EnvError(f"{self.name}={value!r}: expected one of {', '.join(self.choices)}")
        if self.check is not None:
            try:
                self.check(value)
            except ValueError as exc:
                raise EnvError(f"{self.name}={value!r}: {exc}") from exc
        return value


def _check_form(value: str) -> None:
    QuantSpec.from_form(value)


# Where converted models, scratch files and compiled kernels go (else $XDG_CACHE_HOME/rewind).
HOME = Var("REWIND_HOME", "folder for converted models, scratch files and compiled kernels")
# The CPU's C kernels (rewind.kernels.native_forward); the same tuple as its WEIGHT_FORMS
# (tests/test_env.py holds them equal; that module imports MLX, this one must not).
NATIVE_FORMS = ("auto", "bf16", "f32", "int8", "off")
NATIVE = Var("REWIND_NATIVE", "weights the CPU backbone kernels read (off: MLX's layers)",
             NATIVE_FORMS)
NATIVE_OLD = Var("REWIND_NATIVE_DECODE", "REWIND_NATIVE's name when only decode was native",
                 NATIVE_FORMS)
CPU_HEAD = Var("REWIND_CPU_HEAD", "the CPU decode head (rewind.kernels.fast_head; off: MLX's)",
               ("auto", "bf16", "int8", "off"))
CPU_ATTENTION = Var("REWIND_CPU_ATTENTION",
                    "off: mlx-lm's own attention in MLX layers instead of the C kernel",
                    ("on", "off"))
GATED_DELTA = Var("REWIND_GATED_DELTA",
                  "off: mlx-lm's own gated delta recurrence instead of Rewind's kernels",
                  ("on", "off"))
CUDA_ATTENTION = Var("REWIND_CUDA_ATTENTION",
                     "off: on CUDA, a decode batch of rows of mixed lengths takes MLX's masked "
                     "attention instead of Rewind's kernel (rewind.kernels.cuda_attention)",
                     ("on", "off"))
PROMPT_SHAPES = Var("REWIND_PROMPT_SHAPES",
                    "off: on CUDA, a prompt call's attention runs at its exact shapes instead of "
                    "padded ones that repeat (rewind.kernels.prompt_shapes)", ("on", "off"))
COMPILED_DECODE = Var("REWIND_COMPILED_DECODE",
                      "a decode step of MLX's layers over full-attention caches built once per "
                      "batch shape and replayed (mx.compile; rewind.engine.compiled_decode): auto "
                      "(the default) on CUDA, where it was measured faster, off elsewhere; on; off",
                      ("auto", "on", "off"))
FUSED_PROJECTIONS = Var("REWIND_FUSED_PROJECTIONS",
                        "an attention layer's q/k/v projections and an MLP's gate/up ones run as "
                        "one matrix product each (rewind.models.fused_projections): auto (the "
                        "default) with MLX's CUDA backend, off elsewhere; on (any GPU backend); "
                        "off",
                        ("auto", "on", "off"))
FUSED_DECODE = Var("REWIND_FUSED_DECODE",
                   "on CUDA, one row's decode step of a Llama block runs its products with what "
                   "follows them (RoPE, residual adds, the MLP's gate) in four kernels, same bits "
                   "(rewind.kernels.cuda_block): auto (the default) and on; off (mlx-lm's blocks)",
                   ("auto", "on", "off"))
SKINNY_PRODUCTS = Var("REWIND_SKINNY_PRODUCTS",
                      "on CUDA, the matrix products of 2 to 64 rows (decode batches) in Rewind's "
                      "tensor-core kernel, whose rows compute alone, instead of cuBLAS "
                      "(rewind.kernels.cuda_skinny): on; auto (the default) and off: cuBLAS",
                      ("auto", "on", "off"))
FAST_GELU = Var("REWIND_FAST_GELU", "0: mlx-lm's scalar tanh-GELU on the CPU", ("0", "1"))
NO_AVX512 = Var("REWIND_NO_AVX512", "1: build the C kernels for AVX2 even on an AVX-512 CPU",
                ("0", "1"))
NO_AMX = Var("REWIND_NO_AMX", "1: leave AMX tiles unused in the C kernels' prefill products "
             "(they give the same bits; a comparison, or a machine whose AMX misbehaves)",
             ("0", "1"))
KERNEL_ISA = Var("REWIND_KERNEL_ISA", "the C kernels' build: avx2, avx512 or avx512vnni (default: "
                 "the widest this CPU runs)", ("avx2", "avx512", "avx512vnni"))
# scripts/sanitize.sh sets it with the sanitizer's runtime preloaded (a sanitized library does not
# load without it).
SANITIZE = Var("REWIND_SANITIZE", "build the C kernels with sanitizers: address (ASan + UBSan) "
               "or thread (TSan); scripts/sanitize.sh", ("address", "thread"))
COMPUTE_DTYPE = Var("REWIND_COMPUTE_DTYPE", "the dtype models compute in (default per backend)",
                    ("float32", "bfloat16", "float16"))
DEFAULT_FORM = Var("REWIND_DEFAULT_FORM", "the default model's stored form, e.g. q4g32",
                   check=_check_form)
# Any non-empty value opts out (as before): a user's switch, not a value.
NO_OPENBLAS = Var("REWIND_NO_OPENBLAS", "any value: keep MLX's reference BLAS, no OpenBLAS preload")
BLAS_REEXEC = Var("REWIND_BLAS_REEXEC", "set by `rewind` itself when it re-executes with OpenBLAS")
# Read by scripts/setup.sh (the shell), never by Python; declared so it is not reported unknown.
EXTRAS = Var("REWIND_EXTRAS", "the pip extras scripts/setup.sh installs")
# `rewind ps`: which server to ask, and its key (the flags --url and --api-key win).
URL = Var("REWIND_URL", "the server `rewind ps` asks (default http://127.0.0.1:1234)")
API_KEY = Var("REWIND_API_KEY", "the key `rewind ps` sends to the server")
# Tests only (rewind.engine.faults): a trigger file; once it exists, the next forward pass of the
# model it names raises, as a failing kernel would. Unset, nothing is checked.
TEST_FORWARD_FAULT = Var("REWIND_TEST_FORWARD_FAULT",
                         "tests only: a trigger file; once it exists, the next forward pass of "
                         "the model it names raises (and the file is removed)")

ALL: tuple[Var, ...] = (HOME, NATIVE, NATIVE_OLD, CPU_HEAD, CPU_ATTENTION, GATED_DELTA,
                        CUDA_ATTENTION, PROMPT_SHAPES, COMPILED_DECODE, FUSED_PROJECTIONS,
                        FUSED_DECODE, SKINNY_PRODUCTS, FAST_GELU, NO_AVX512, NO_AMX, SANITIZE,
                        COMPUTE_DTYPE, DEFAULT_FORM, NO_OPENBLAS, BLAS_REEXEC, EXTRAS, URL,
                        API_KEY, TEST_FORWARD_FAULT)


def check_all() -> list[str]:
    """Raise EnvError for the first REWIND_* variable holding a value it does not take. Returns
    a warning for each REWIND_* name that is none of these (a misspelt variable does nothing);
    a warning, not an error, since a name may be another tool's."""
    for var in ALL:
        var.get()
    known = {var.name for var in ALL}
    return [f"{name} is not a Rewind variable (it has no effect; known: {', '.join(sorted(known))})"
            for name in sorted(os.environ) if name.startswith("REWIND_") and name not in known]


# ---- typed readers: what the rest of Rewind calls ----------------------------------------------


def home() -> Path | None:
    value = HOME.get()
    return Path(value).expanduser() if value else None


def native_form() -> str | None:
    """REWIND_NATIVE, else its old name; None when neither is set."""
    return NATIVE.get() or NATIVE_OLD.get()


def cpu_head() -> str | None:
    return CPU_HEAD.get()


def cpu_attention_off() -> bool:
    return CPU_ATTENTION.get() == "off"


def gated_delta_off() -> bool:
    return GATED_DELTA.get() == "off"


def cuda_attention_off() -> bool:
    return CUDA_ATTENTION.get() == "off"


def prompt_shapes_off() -> bool:
    return PROMPT_SHAPES.get() == "off"


def compiled_decode() -> str:
    """auto, on or off (rewind.engine.compiled_decode decides what auto means)."""
    return COMPILED_DECODE.get() or "auto"


def fused_projections() -> str:
    """auto, on or off (rewind.models.fused_projections decides what auto means)."""
    return FUSED_PROJECTIONS.get() or "auto"


def fused_decode() -> str:
    """auto, on or off (rewind.kernels.cuda_block: auto and on mean on with CUDA)."""
    return FUSED_DECODE.get() or "auto"


def skinny_products() -> str:
    """auto, on or off (rewind.kernels.cuda_skinny: on means on with CUDA; auto is off)."""
    return SKINNY_PRODUCTS.get() or "auto"


def fast_gelu() -> bool:
    return FAST_GELU.get() != "0"


def no_avx512() -> bool:
    return NO_AVX512.get() == "1"


def no_amx() -> bool:
    return NO_AMX.get() == "1"


def kernel_isa() -> str | None:
    return KERNEL_ISA.get()


def sanitize() -> str | None:
    return SANITIZE.get()


def compute_dtype() -> str | None:
    return COMPUTE_DTYPE.get()


def default_form() -> str | None:
    return DEFAULT_FORM.get()


def no_openblas() -> bool:
    return NO_OPENBLAS.get() is not None


def blas_reexecuted() -> bool:
    return BLAS_REEXEC.get() is not None


def server_url() -> str | None:
    return URL.get()


def api_key() -> str | None:
    return API_KEY.get()


def forward_fault_file() -> Path | None:
    value = TEST_FORWARD_FAULT.get()
    return Path(value).expanduser() if value else None


@contextmanager
def overridden(values: Mapping[Var, str]) -> Iterator[None]:
    """Set these variables for the block, then restore them (unset ones unset): a benchmark's
    rows of mlx-lm as shipped (REWIND_CPU_ATTENTION / REWIND_GATED_DELTA off) in Rewind's
    process."""
    saved = {var: os.environ.get(var.name) for var in values}
    for var, value in values.items():
        if var.choices and value not in var.choices:
            raise EnvError(f"{var.name}={value!r}: expected one of {', '.join(var.choices)}")
        os.environ[var.name] = value
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var.name, None)
            else:
                os.environ[var.name] = value
