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


# REWIND_CPU_HEAD=auto|bf16|int8|off chooses the CPU decode head (rewind.engine.fast_head);
# auto: the bf16 head where it is exact (bf16 checkpoints such as the CPU default), else MLX's.
CPU_HEAD_ENV = "REWIND_CPU_HEAD"
DEFAULT_CPU_HEAD = "auto"
# REWIND_FAST_GELU=0 keeps mlx-lm's scalar tanh-GELU on CPU (rewind.models.cpu_activations).
FAST_GELU_ENV = "REWIND_FAST_GELU"


def is_cpu_backend() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def compute_dtype() -> Any:
    """float32 on CPU (only float32 matmuls reach OpenBLAS; MLX's own bf16/fp16/quantized CPU
    kernels are several times slower), bfloat16 on Metal and CUDA (half the bytes per token)."""
    import mlx.core as mx

    return mx.float32 if is_cpu_backend() else mx.bfloat16


def prepare_for_backend(model: Any, dtype: Any | None = None, cpu_head: str | None = None,
                        native_decode: str | None = None) -> Any:
    """Set the model's compute dtype for this backend, in place.

    CPU: quantized layers are dequantized (MLX's CPU quantized matmul is no faster than float32
    through BLAS, so keeping them packed saves memory but costs speed), floats become float32,
    Gemma 3's tanh-GELU becomes a vectorized one (rewind.models.cpu_activations), and
    the output projection gets a bf16/int8 copy read by a C kernel for decode (see
    rewind.engine.fast_head; `cpu_head` "off" keeps MLX's), and one-token steps go through C
    kernels (rewind.engine.native_decode; `native_decode` or REWIND_NATIVE_DECODE "off" keeps
    MLX's). GPU: float weights become bfloat16;
    quantized layers stay quantized (the GPU kernels for them are fast).
    """
    import os

    import mlx.core as mx
    from mlx.utils import tree_map

    target = dtype or compute_dtype()
    on_cpu = is_cpu_backend()
    if on_cpu and target == mx.float32:
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
    model.update(tree_map(lambda value: value.astype(target)
                          if mx.issubdtype(value.dtype, mx.floating) else value, model.parameters()))
    mx.eval(model.parameters())
    if on_cpu and os.environ.get(FAST_GELU_ENV, "1") != "0":
        from rewind.models.cpu_activations import use_fast_gelu

        use_fast_gelu(model)
    head_form = cpu_head or os.environ.get(CPU_HEAD_ENV) or DEFAULT_CPU_HEAD
    if on_cpu and head_form != "off":
        from rewind.engine.fast_head import install_fast_head

        install_fast_head(model, head_form)
    if on_cpu:
        from rewind.engine.native_decode import install_native_decoder

        install_native_decoder(model, native_decode)
    return model


def load_model(name_or_path: str, *, dtype: Any | None = None, cpu_head: str | None = None,
               native_decode: str | None = None) -> LoadedModel:
    """Load a model folder or registry name, ready to compute on this backend (see
    prepare_for_backend; `dtype` overrides the per-backend compute dtype)."""
    from mlx_lm.utils import load

    path = resolve(name_or_path)
    model, tokenizer = load(str(path))
    prepare_for_backend(model, dtype, cpu_head, native_decode)
    config = json.loads((path / "config.json").read_text())
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=name_or_path,
                       config=config, fingerprint=model_fingerprint(path))
