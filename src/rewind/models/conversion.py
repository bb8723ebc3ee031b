"""GGUF file or HF safetensors folder -> mlx-lm model folder, written atomically under a lock.

The folder is built in a hidden temporary sibling (`.NAME.partial-PID-RANDOM`) and renamed into
place at the very end, so an exception, Ctrl-C or a crash never leaves a half-written model where
a loader would find it. A lock file beside it (`.NAME.lock`, flock) makes a second process that
wants the same folder wait and then reuse the first one's result.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rewind import __version__
from rewind.forms import QuantSpec
from rewind.models.gguf_file import GgufError

META_FILE = "rewind.json"  # what we converted from and how; read by `rewind models`


# -- atomic folder and lock --------------------------------------------------------------------

def _partial_prefix(final: Path) -> str:
    return f".{final.name}.partial-"


def remove_stale_partials(final: Path) -> None:
    """Remove temp folders that a killed process (SIGKILL, power loss) left beside `final`."""
    if not final.parent.exists():
        return
    for leftover in final.parent.glob(_partial_prefix(final) + "*"):
        pid_text = leftover.name[len(_partial_prefix(final)):].split("-")[0]
        if pid_text.isdigit() and _pid_alive(int(pid_text)):
            continue
        shutil.rmtree(leftover, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield an empty temp folder; on success it becomes `final`, on any exception (Ctrl-C too) it is
    removed. `final` must not exist yet."""
    if final.exists():
        raise FileExistsError(f"{final} already exists; remove it first or choose another --out")
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f"{_partial_prefix(final)}{os.getpid()}-{secrets.token_hex(4)}"
    temp.mkdir()
    try:
        yield temp
        os.rename(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


@contextlib.contextmanager
def folder_lock(final: Path) -> Iterator[None]:
    """An exclusive flock on `.NAME.lock` beside `final`; released when the process dies, too."""
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.parent / f".{final.name}.lock"
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process that is converting {final.name} ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# -- conversion ----------------------------------------------------------------------------------

def _progress(total: int, description: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="step", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=False)


def _store(model: Any, config: dict[str, Any], spec: QuantSpec, out_dir: Path) -> dict[str, Any]:
    """Cast floats to bfloat16, quantize if asked, save weights and config. Returns the config saved."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import quantize_model, save_config, save_model

    model.update(tree_map(lambda value: value.astype(mx.bfloat16)
                          if mx.issubdtype(value.dtype, mx.floating) else value, model.parameters()))
    if spec.bits != 16:
        model, config = quantize_model(model, config, spec.group_size, spec.bits)
    mx.eval(model.parameters())
    save_model(out_dir, model, donate_model=True)
    save_config(dict(config), config_path=out_dir / "config.json")
    return config


def _convert_gguf(src: Path, out_dir: Path, spec: QuantSpec, show_progress: bool) -> None:
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from rewind.models.gguf_file import GgufFile
    from rewind.models.gguf_import import check_architecture, hf_config, iter_hf_weights
    from rewind.models.gguf_tokenizer import write_tokenizer

    with GgufFile(src) as gguf:
        arch = check_architecture(gguf)
        config = hf_config(gguf)
        bar = _progress(len(gguf.tensors) + 2, f"converting {src.name}", show_progress)
        with bar:
            weights: dict[str, mx.array] = {}
            for name, weight in iter_hf_weights(gguf, config, on_tensor=lambda _: bar.update(1)):
                weights[name] = mx.array(weight).astype(mx.bfloat16)
                mx.eval(weights[name])  # free the float32 numpy copy now, not at the end
            model_class, args_class = _get_classes(config)
            model = model_class(args_class.from_dict(config))
            weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
            try:
                model.load_weights(list(weights.items()), strict=True)
            except ValueError as exc:
                raise GgufError(f"{src}: its tensors do not fit an mlx-lm {config['model_type']} model: {exc}") from exc
            del weights
            bar.set_description("tokenizer")
            write_tokenizer(gguf, out_dir, arch)
            bar.update(1)
            bar.set_description("saving" if spec.bits == 16 else f"quantizing to {spec.form}")
            _store(model, config, spec, out_dir)
            bar.update(1)


def _convert_hf_folder(src: Path, out_dir: Path, spec: QuantSpec, show_progress: bool) -> None:
    from mlx_lm.utils import load_model, load_tokenizer

    bar = _progress(3, f"converting {src.name}", show_progress)
    with bar:
        model, config = load_model(src, lazy=True)
        bar.update(1)
        tokenizer = load_tokenizer(src, eos_token_ids=config.get("eos_token_id"))
        tokenizer.save_pretrained(str(out_dir))
        for extra in ("generation_config.json", "chat_template.jinja", "chat_template.json"):
            if (src / extra).exists() and not (out_dir / extra).exists():
                shutil.copy(src / extra, out_dir / extra)
        bar.update(1)
        if "quantization" in config or "quantization_config" in config:
            raise ValueError(f"{src} is already quantized; rewind convert takes float weights")
        _store(model, config, spec, out_dir)
        bar.update(1)


def _import_heavy_modules(from_gguf: bool) -> None:
    """Import the C extensions before the temp folder exists: a Ctrl-C that lands inside an
    extension's init (nanobind's, for mlx) aborts the process with no cleanup at all."""
    import mlx.core  # noqa: F401
    import mlx_lm.utils  # noqa: F401
    import tqdm  # noqa: F401

    if from_gguf:
        import gguf.quants  # noqa: F401
        import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401


def convert(src: Path, out: Path, spec: QuantSpec, show_progress: bool = True) -> Path:
    """Convert `src` (a .gguf file or a HF folder of safetensors) into the mlx-lm folder `out`.

    Atomic and locked: if another process finishes `out` first, its result is returned as is."""
    src = Path(src).expanduser()
    if not src.exists():
        raise FileNotFoundError(f"nothing to convert at {src}")
    if src.is_dir() and not (src / "config.json").exists():
        raise FileNotFoundError(f"{src} is a folder without config.json: not a Hugging Face model folder")
    _import_heavy_modules(from_gguf=not src.is_dir())
    with folder_lock(out):
        if is_model_folder(out):
            return out
        remove_stale_partials(out)
        started = time.perf_counter()
        with atomic_folder(out) as temp:
            if src.is_dir():
                _convert_hf_folder(src, temp, spec, show_progress)
            else:
                _convert_gguf(src, temp, spec, show_progress)
            meta = {"source": str(src), "form": spec.form, "bits": spec.bits, "group_size": spec.group_size,
                    "seconds": round(time.perf_counter() - started, 2), "rewind_version": __version__}
            (temp / META_FILE).write_text(json.dumps(meta, indent=2))
    return out


def folder_size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
