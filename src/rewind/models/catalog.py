"""Every model one server can serve, by the names requests use.

What `rewind models` lists (the default, converted models in models_dir(), folders named with
`--model`), plus models in the Hugging Face cache by repo id (what `rewind pull` puts there).
Each entry knows its form (bf16, q8, q4...), its size on disk and its context length, and the
"base" it is a form of: the memory budget falls back to a smaller form of the same base.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.forms import QuantSpec
from rewind.models import hf_cache
from rewind.models.conversion import META_FILE, is_model_folder
from rewind.models.registry import (
    DEFAULT_NAME,
    ModelNotFoundError,
    _default_form_of,
    default_form,
    default_model_dir,
    list_models,
)

# A trailing form in a folder or repo name: Qwen3-4B-4bit, gemma-3-1b-it-bf16, foo-q8, foo-8bit.
_FORM_SUFFIX = re.compile(r"[-_](bf16|fp16|f16|f32|fp32|q\d+(?:g\d+)?|\d+bit|mxfp4)$", re.I)


@dataclass(frozen=True)
class Servable:
    name: str  # the id /v1/models shows and requests name
    path: Path  # model folder (or a .gguf file, converted on first load)
    kind: str  # default | converted | local | hf
    form: str  # bf16, q8, q4, f32, ...
    base: str  # what it is a form of (fallback goes to another form of the same base)
    size_bytes: int
    context_length: int | None
    aliases: tuple[str, ...] = field(default_factory=tuple)  # other names that reach it
    ready: bool = True  # False: the default, converted on first load

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def context_length(model_config: dict[str, Any]) -> int | None:
    """The model's trained context, from its config (nested text_config for multimodal ones)."""
    for config in (model_config, model_config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            if isinstance(config.get(key), int) and config[key] > 0:
                return config[key]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _safetensors_dtype(folder: Path) -> str | None:
    """The dtype of the first floating tensor of the first weight file (its header only)."""
    from rewind.models.memory_estimate import safetensors_header

    for weights in sorted(folder.glob("*.safetensors")):
        for name, info in safetensors_header(weights).items():
            if name != "__metadata__" and info.get("dtype") in ("BF16", "F16", "F32"):
                return {"BF16": "bf16", "F16": "f16", "F32": "f32"}[info["dtype"]]
    return None


def folder_form(folder: Path, config: dict[str, Any] | None = None) -> str:
    config = config if config is not None else _read_json(folder / "config.json")
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("bits"), int):
        try:
            return QuantSpec(quant["bits"], int(quant.get("group_size", 64))).form
        except ValueError:
            return f"q{quant['bits']}"
    meta = _read_json(folder / META_FILE)
    if isinstance(meta.get("form"), str):
        return meta["form"]
    return _safetensors_dtype(folder) or "unknown"


def _base_of(name: str, folder: Path, kind: str) -> str:
    """Forms of one model share a base: what they were converted from (rewind convert's
    rewind.json), a local folder itself, else the name without its form suffix."""
    meta = _read_json(folder / META_FILE)
    if isinstance(meta.get("source"), str) and meta["source"]:
        return str(Path(meta["source"]).expanduser().resolve())
    if kind == "local":
        return str(folder.resolve())
    return _FORM_SUFFIX.sub("", name)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file())


def describe(name: str, path: Path, kind: str, aliases: tuple[str, ...] = (),
             base: str | None = None) -> Servable:
    if path.is_file():  # a GGUF in the Hugging Face cache: converted to bf16 when loaded
        return Servable(name=name, path=path, kind=kind, form="gguf", base=base or name,
                        size_bytes=_size(path), context_length=None, aliases=aliases)
    config = _read_json(path / "config.json")
    return Servable(name=name, path=path, kind=kind, form=folder_form(path, config),
                    base=base or _base_of(name, path, kind), size_bytes=_size(path),
                    context_length=context_length(config), aliases=aliases,
                    ready=is_model_folder(path))


class Catalog:
    """Servable models by name. Rebuilt with refresh() (a pull or a conversion adds one)."""

    def __init__(self, model_args: list[str] | tuple[str, ...] = ()) -> None:
        self.model_args = list(model_args)
        self._entries: list[Servable] = []
        self._fixed = False
        self.refresh()

    @classmethod
    def fixed(cls, entries: list[Servable]) -> Catalog:
        """A catalog of exactly these entries (a server handed one loaded model)."""
        catalog = cls.__new__(cls)
        catalog.model_args = []
        catalog._entries = list(entries)
        catalog._fixed = True
        return catalog

    def refresh(self) -> None:
        entries: list[Servable] = []
        default_dir = default_model_dir(default_form())
        default_aliases: list[str] = []
        for entry in list_models():
            if entry.kind == "default":
                continue
            if entry.path == default_dir:  # `default` itself, in the backend's form
                default_aliases.append(entry.name)
                continue
            base = DEFAULT_NAME if _default_form_of(entry.name) else None
            entries.append(describe(entry.name, entry.path, "converted", base=base))
        if is_model_folder(default_dir):
            first = describe(DEFAULT_NAME, default_dir, "default", tuple(default_aliases),
                             base=DEFAULT_NAME)
        else:
            first = Servable(name=DEFAULT_NAME, path=default_dir, kind="default",
                             form=default_form(), base=DEFAULT_NAME, size_bytes=0,
                             context_length=None, ready=False)
        entries.insert(0, first)
        for repo, path in hf_cache.cached_models():
            entries.append(describe(repo, path, "hf"))
        for arg in self.model_args:
            if self._find(entries, arg) is None:
                folder = Path(arg).expanduser()
                if folder.is_dir() and is_model_folder(folder):
                    aliases = tuple(dict.fromkeys(
                        a for a in (folder.name, str(folder.resolve())) if a != arg))
                    entries.append(describe(arg, folder, "local", aliases))
        # The models named on the command line first: a client that takes the first model
        # /v1/models lists (agents' defaults, benchmark harnesses) gets the one being served.
        named: list[Servable] = []
        for arg in self.model_args:
            entry = self._find(entries, arg)
            if entry is not None and all(entry is not seen for seen in named):
                named.append(entry)
        self._entries = named + [e for e in entries if all(e is not seen for seen in named)]

    @staticmethod
    def _find(entries: list[Servable], name: str) -> Servable | None:
        for entry in entries:
            if name in entry.names:
                return entry
        return None

    @property
    def is_fixed(self) -> bool:
        """A catalog of given entries only (refresh() would not add pulled models to it)."""
        return self._fixed

    @property
    def entries(self) -> list[Servable]:
        return list(self._entries)

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self._entries]

    def lookup(self, name: str) -> Servable:
        """The entry `name` reaches; a `default-<form>` not converted yet, a .gguf or a folder
        path are servable too (converted or read on first load). ModelNotFoundError otherwise."""
        entry = self._find(self._entries, name)
        if entry is not None:
            return entry
        if self._fixed:
            raise ModelNotFoundError(f"no model {name!r}")
        form = _default_form_of(name)
        if form is not None:
            entry = Servable(name=name, path=default_model_dir(form), kind="default", form=form,
                             base=DEFAULT_NAME, size_bytes=0, context_length=None, ready=False)
        else:
            path = Path(name).expanduser()
            if path.is_dir() and is_model_folder(path):
                entry = describe(name, path, "local")
            elif path.is_file() and path.suffix == ".gguf":
                entry = describe(name, path, "local")
        if entry is None:
            raise ModelNotFoundError(f"no model {name!r}; this server serves: "
                                     + ", ".join(self.names))
        self._entries.append(entry)
        return entry

    def forms_of(self, entry: Servable) -> list[Servable]:
        """Other ready forms of the same base model."""
        return [other for other in self._entries
                if other.base == entry.base and other.path != entry.path and other.ready]
