"""Load an mlx-lm model folder (or a registry name) into a LoadedModel."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LoadedModel:
    model: Any  # mlx.nn.Module from mlx-lm
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path
    name: str
    config: dict
    fingerprint: str  # hex digest of config + weight files: part of every prompt-cache key


def model_fingerprint(path: Path) -> str:
    """Identifies weights, config and quantization without hashing gigabytes: the config text and
    each weight file's name, size and first/last MiB."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()


def resolve(name_or_path: str) -> Path:
    """A registry name (e.g. 'default') or a folder path -> the model folder."""
    try:
        from rewind.models.registry import resolve_model
    except ModuleNotFoundError:
        resolve_model = None
    if resolve_model is not None:
        return resolve_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model folder at {path} (looked for {path / 'config.json'})")
    return path


def load_model(name_or_path: str) -> LoadedModel:
    from mlx_lm.utils import load

    path = resolve(name_or_path)
    model, tokenizer = load(str(path))
    config = json.loads((path / "config.json").read_text())
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=name_or_path,
                       config=config, fingerprint=model_fingerprint(path))
