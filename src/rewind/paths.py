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
