"""Where Rewind keeps its files: the XDG cache folder for converted models and scratch files."""

from __future__ import annotations

import os
from pathlib import Path

from rewind import env


def cache_home() -> Path:
    """$REWIND_HOME, else $XDG_CACHE_HOME/rewind, else ~/.cache/rewind."""
    home = env.home()
    if home is not None:
        return home
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rewind"


def models_dir() -> Path:
    return cache_home() / "models"


def scratch_dir() -> Path:
    return cache_home() / "scratch"


def mlx_kernel_cache_dir() -> Path:
    """Where MLX's CUDA backend keeps the kernels it compiles (MLX_PTX_CACHE_DIR). MLX's own
    default is under the temporary folder, which many systems empty at boot: the first request
    after each reboot then waited seconds for NVRTC. One folder per MLX version, as MLX's
    default has, so a new MLX never loads an older one's kernels."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mlx_version = version("mlx")
    except PackageNotFoundError:
        mlx_version = "unknown"
    return cache_home() / "mlx" / mlx_version / "ptx"
