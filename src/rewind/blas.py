"""Make MLX's CPU backend use OpenBLAS instead of the reference BLAS bundled with mlx[cpu].

The mlx[cpu] wheel links a reference BLAS (~4 GFLOP/s for a 1024x1024 float32 matmul). Debian's
OpenBLAS exports the same symbols; preloading it (LD_PRELOAD) before libmlx is loaded makes MLX call
it (70-120 GFLOP/s here). A preload only works at process start, so the `rewind` command re-executes
itself once with LD_PRELOAD set. Nothing here imports mlx.
"""

from __future__ import annotations

import glob
import os
import platform
import sys

from rewind import env

# Guards against an exec loop (REWIND_BLAS_REEXEC) and lets a user opt out (REWIND_NO_OPENBLAS).
_REEXEC_MARK = env.BLAS_REEXEC.name

_CANDIDATES = (
    "/usr/lib/*/openblas-pthread/libblas.so.3",
    "/usr/lib/*/openblas-openmp/libblas.so.3",
    "/usr/lib/*/openblas-serial/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas() -> str | None:
    """Path of an OpenBLAS that provides the BLAS symbols, or None."""
    for pattern in _CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def openblas_active() -> bool:
    return any("openblas" in part for part in os.environ.get("LD_PRELOAD", "").split(":"))


def status() -> str:
    """One line for logs and --verbose: which BLAS this process uses."""
    if platform.system() != "Linux":
        return "BLAS: platform default (Accelerate/Metal on macOS)"
    if openblas_active():
        return "BLAS: OpenBLAS (preloaded)"
    if env.no_openblas():
        return "BLAS: MLX reference BLAS (OpenBLAS disabled by REWIND_NO_OPENBLAS)"
    if find_openblas() is None:
        return ("BLAS: MLX reference BLAS (slow). Install Debian's libopenblas0-pthread "
                "(apt-get install libopenblas0-pthread) for 5-8x faster prefill")
    return "BLAS: MLX reference BLAS (OpenBLAS found but not preloaded)"


def preload_value() -> str:
    """LD_PRELOAD value that adds OpenBLAS to the current one (unchanged when none is found)."""
    current = os.environ.get("LD_PRELOAD", "")
    lib = find_openblas()
    if platform.system() != "Linux" or lib is None or openblas_active() or env.no_openblas():
        return current
    # After what is there: a sanitizer's runtime must stay first (scripts/sanitize.sh), and any
    # preloaded library comes before libmlx, wherever it stands in the list.
    return f"{current}:{lib}" if current else lib


def ensure_openblas(argv: list[str]) -> None:
    """Re-exec this command with OpenBLAS preloaded, once, when it is available and not loaded.

    Called first thing by the CLI, before mlx is imported. Returns when nothing is to be done.
    """
    if platform.system() != "Linux" or openblas_active() or env.blas_reexecuted():
        return
    if env.no_openblas() or "mlx.core" in sys.modules:
        return
    value = preload_value()
    if not value or "openblas" not in value:
        return
    child = dict(os.environ)
    child["LD_PRELOAD"] = value
    child[_REEXEC_MARK] = "1"
    # BLAS threads beyond the physical cores fight each other and MLX's own threads.
    child.setdefault("OPENBLAS_NUM_THREADS", str(os.cpu_count() or 1))
    try:
        os.execve(sys.executable, [sys.executable, "-m", "rewind", *argv], child)
    except OSError:
        return  # keep running on the reference BLAS; status() says so


def _main() -> None:
    if "--preload-value" in sys.argv:
        print(preload_value())
    else:
        print(status())


if __name__ == "__main__":
    _main()
