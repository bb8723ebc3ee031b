"""Load an mlx-lm model folder (or a registry name) into a LoadedModel."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewind import env
from rewind.memory import release_free_heap


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


# REWIND_CPU_HEAD=auto|bf16|int8|off chooses the CPU decode head (rewind.kernels.fast_head);
# auto: the bf16 head where it is exact (bf16 checkpoints such as the CPU default), else MLX's.
# REWIND_FAST_GELU=0 keeps mlx-lm's scalar tanh-GELU on CPU (rewind.models.cpu_activations).
# Both are read through rewind.env.
DEFAULT_CPU_HEAD = "auto"


def is_cpu_backend() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


# REWIND_COMPUTE_DTYPE=float32|bfloat16|float16 (rewind.env) overrides the per-backend default
# (e.g. float32 on a GPU, for answers that match the CPU's; with MLX_ENABLE_TF32=0 there for full
# precision).


def compute_dtype() -> Any:
    """float32 on CPU (Rewind's C kernels, and BLAS, compute in float32; MLX's own bf16/fp16/
    quantized CPU kernels are several times slower), bfloat16 on Metal and CUDA (half the bytes
    per token); REWIND_COMPUTE_DTYPE overrides it."""
    import mlx.core as mx

    override = env.compute_dtype()  # an EnvError (ValueError) names a bad value's choices
    if override:
        return getattr(mx, override)
    return mx.float32 if is_cpu_backend() else mx.bfloat16


def _cast_floats(model: Any, dtype: Any) -> None:
    import mlx.core as mx
    from mlx.utils import tree_map

    model.update(tree_map(lambda value: value.astype(dtype)
                          if mx.issubdtype(value.dtype, mx.floating) else value, model.parameters()))
    mx.eval(model.parameters())


def materialize_constants(model: Any, parameters: bool = True) -> None:
    """Evaluate every array the model's modules hold, not only its parameters (`parameters`
    False: only the others, for a model whose weights are read in place and stay unread).

    Some layers keep constants outside `parameters()` (mlx-lm's Llama 3, YaRN, SuScaled and
    proportional ropes keep a lazy `_freqs`). Left lazy, they are computed at the first forward
    pass, on the engine's thread, where MLX refuses a graph built on the loading thread's stream
    ("There is no Stream(cpu, 0) in current thread")."""
    import mlx.core as mx

    constants = [value for module in model.modules() for key, value in module.items()
                 if isinstance(value, mx.array) and (parameters or key.startswith("_"))]
    if constants:
        mx.eval(constants)


def use_mlx_layers(model: Any, native_forward: str | None = None) -> Any:
    """Run `model` through MLX's own layers on the CPU, ready for speed: the native forward pass
    (if any) is removed, quantized layers are dequantized, bf16 Linear layers keep their weights
    and run in the C matrix kernel and lookup-only bf16 tables stay bf16
    (rewind.kernels.native_linear, rewind.kernels.stored_embedding; not when `native_forward` or
    REWIND_NATIVE is "off"),
    other floats are widened to float32 (only float32 matmuls reach BLAS), attention and the
    gated delta rule go through Rewind's C kernels (rewind.kernels.cpu_attention,
    rewind.kernels.gated_delta), and Gemma 3's tanh-GELU becomes a vectorized one
    (rewind.models.cpu_activations). For families the C kernels do not implement, and for
    models whose layers change after loading (rewind.vision.mrope)."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    from rewind.kernels.native_forward import remove_native_forward, requested_form

    remove_native_forward(model)
    dequantize_model(model)
    if requested_form(native_forward or env.native_form()) != "off":
        from rewind.kernels import native_linear, stored_embedding

        native_linear.use_in_model(model)  # bf16 Linears stay bf16, read by the C matrix kernel
        stored_embedding.use_in_model(model)  # lookup-only bf16 tables stay bf16
    _cast_floats(model, mx.float32)
    from rewind.kernels import cpu_attention, gated_delta

    cpu_attention.use_in_mlx_layers(model)
    gated_delta.use_in_model(model)
    if env.fast_gelu():
        from rewind.models.cpu_activations import use_fast_gelu

        use_fast_gelu(model)
    return model


def prepare_for_backend(model: Any, dtype: Any | None = None, cpu_head: str | None = None,
                        native_forward: str | None = None, stored: Any = None,
                        fuse_projections: bool = True) -> Any:
    """Set up the model's compute for this backend, in place.

    CPU: the backbone runs through Rewind's C kernels where the family allows
    (rewind.kernels.native_forward; `native_forward` or REWIND_NATIVE "off" keeps MLX's), reading
    the stored weights in place; otherwise through MLX's layers widened to float32
    (`use_mlx_layers`). The output projection gets a bf16/int8 copy read by a C kernel for the
    logits (rewind.kernels.fast_head; `cpu_head` "off" keeps MLX's). GPU: float weights become
    bfloat16; quantized layers stay quantized (the GPU kernels for them are fast); sibling
    projections run as one product where REWIND_FUSED_PROJECTIONS allows and `fuse_projections`
    (a model about to be sharded by projection name: False) does
    (rewind.models.fused_projections).
    """
    import mlx.core as mx

    target = dtype or compute_dtype()
    if not is_cpu_backend():
        from rewind.kernels.gated_delta import use_in_model

        _cast_floats(model, target)
        use_in_model(model)  # the CUDA kernel for linear attention (Metal keeps mlx-lm's)
        if fuse_projections:
            from rewind.models import fused_projections

            if fused_projections.wanted():
                fused_projections.use_in_model(model)
        if mx.cuda.is_available():
            from rewind.kernels import (cuda_attention, cuda_block, cuda_rows, cuda_skinny,
                                        shifted_conv)

            shifted_conv.use_in_model(model)  # no cuDNN plan per new prompt-chunk length
            # a decode batch of rows of mixed lengths without MLX's masked (unfused) attention;
            # Metal's fused attention takes the mask itself
            cuda_attention.use_in_model(model)
            # a drafted row's check with each position's bits a one-token step's (speculation)
            cuda_rows.use_in_model(model)
            # with REWIND_SKINNY_PRODUCTS=on, products of 2-64 rows in Rewind's kernel, not cuBLAS
            cuda_skinny.use_in_model(model)
            # one row's decode step of a Llama block in fewer kernels, the same bits (after the
            # fused projections and the attention's routing, which it reads)
            cuda_block.use_in_model(model)
        return model
    if stored is not None:
        from rewind.kernels.fast_head import install_fast_head
        from rewind.kernels.native_forward import install_native_forward

        if install_native_forward(model, "gguf", stored) is not None:
            install_fast_head(model, "gguf", stored)
            return model
        use_mlx_layers(model, native_forward)  # a family the kernels do not run: MLX's layers
    elif target != mx.float32:
        _cast_floats(model, target)
    else:
        from rewind.kernels.native_forward import install_native_forward

        if install_native_forward(model, native_forward or env.native_form()) is None:
            use_mlx_layers(model, native_forward)
    head_form = cpu_head or env.cpu_head() or DEFAULT_CPU_HEAD
    if head_form != "off":
        from rewind.kernels.fast_head import install_fast_head

        install_fast_head(model, head_form)
    return model


# --cpu-weights: what the CPU reads for each token. "gguf": the GGUF file the model was converted
# from, its blocks read in place (the weights llama.cpp runs; rewind.models.gguf_weights).
# "exact": the model folder's weights (bf16 read in place; the checkpoint's answer). "int8": int8
# layers and head with one scale per row. "auto": the GGUF in place where the folder came from
# one that is still there, else exact. Other backends ignore it (Metal and CUDA run MLX's
# formats).
CPU_WEIGHTS = ("auto", "gguf", "exact", "int8")


def cpu_weight_options(choice: str) -> dict[str, Any]:
    """load_model keyword arguments for a --cpu-weights choice."""
    if choice not in CPU_WEIGHTS:
        raise ValueError(f"--cpu-weights {choice!r}: expected one of {', '.join(CPU_WEIGHTS)}")
    if choice == "int8":
        return {"native_forward": "int8", "cpu_head": "int8", "in_place": False}
    return {"auto": {}, "gguf": {"in_place": True}, "exact": {"in_place": False}}[choice]


def gguf_source(path: Path) -> Path | None:
    """The GGUF file a converted model folder came from, where it is still there."""
    from rewind.models.conversion import META_FILE

    try:
        source = json.loads((path / META_FILE).read_text()).get("source", "")
    except (OSError, ValueError):
        return None
    candidate = Path(source) if isinstance(source, str) and source.endswith(".gguf") else None
    return candidate if candidate is not None and candidate.is_file() else None


def _stored_weights(path: Path, in_place: bool | None, explicit_forms: bool) -> Any:
    """The GGUF weights to read in place for the folder at `path`, or None (see CPU_WEIGHTS)."""
    import logging

    from rewind.models.gguf_file import GgufError
    from rewind.models.gguf_weights import stored_weights

    # "auto" reads the GGUF in place where the folder came from one. Its int8 activations turn
    # any float-order difference into another rounding; the kernels give each row the same bits
    # in any chunking, batch or cache layout (attention.c sums keys in order of position), so a
    # cached answer is the uncached one here too (tests/test_prompt_cache_equivalence.py).
    if in_place is False or not is_cpu_backend() or explicit_forms and in_place is None:
        return None
    source = gguf_source(path)
    if source is None:
        if in_place:
            raise ValueError(f"--cpu-weights gguf: {path} was not converted from a GGUF file "
                             f"that is still there (see {path / 'rewind.json'})")
        return None
    try:
        return stored_weights(source)
    except GgufError as exc:
        if in_place:
            raise ValueError(f"--cpu-weights gguf: {exc}") from exc
        logging.getLogger(__name__).info("GGUF weights not read in place: %s", exc)
        return None


def describe_compute(model: Any) -> str:
    """One line on how `model` computes here, for --verbose and logs."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from rewind.kernels.fast_head import fast_head
    from rewind.kernels.native_forward import native_forward

    head = fast_head(model)
    head_text = f"{head.form} head (C kernel)" if head is not None else "MLX head"
    forward = native_forward(model)
    if forward is not None and forward.form == "gguf":
        return (f"Compute: GGUF blocks read in place ({forward.stored_types}; C kernels, int8 "
                f"dot products), {head_text}")
    if forward is not None:
        return f"Compute: {forward.form} layers (C kernels, float32 math), {head_text}"
    from rewind.kernels.native_linear import native_linear_bytes

    dtypes = sorted({str(v.dtype).split(".")[-1] for _, v in tree_flatten(model.parameters())
                     if mx.issubdtype(v.dtype, mx.floating)})
    linear_text = (", bf16 Linear layers in C kernels" if native_linear_bytes(model) else "")
    return f"Compute: MLX layers ({', '.join(dtypes)}){linear_text}, {head_text}"


def load_model(name_or_path: str, *, dtype: Any | None = None, cpu_head: str | None = None,
               native_forward: str | None = None, tokenizer: Any = None,
               in_place: bool | None = None, fuse_projections: bool = True) -> LoadedModel:
    """Load a model folder or registry name, ready to compute on this backend (see
    prepare_for_backend; `dtype` overrides the per-backend compute dtype). `tokenizer`: one
    already loaded from the same files (a server holding two forms of one model parses it once).
    `in_place`: read the GGUF the folder came from in place on the CPU (True), never (False),
    or where there is one and no other form was asked for (None; CPU_WEIGHTS).
    `fuse_projections`: False keeps every projection a layer of its own on a GPU (a model to be
    sharded by layer name)."""
    from mlx_lm.utils import load_model as load_mlx_model

    from rewind.models.folder_quirks import model_classes, model_config_overrides
    from rewind.models.tokenizer_loading import load_tokenizer

    path = resolve(name_or_path)
    config = json.loads((path / "config.json").read_text())
    # Fields some folders leave to transformers' defaults (llava-hf's LLaVA 1.5 text sizes).
    overrides = model_config_overrides(config) or None
    # What mlx-lm's `load` does, with Rewind's classes for folders mlx-lm has none for (Idefics
    # 3's llama) and its tokenizer loader (the same tokenizer, parsed once).
    classes = model_classes(config)
    explicit_forms = any(v is not None for v in (dtype, cpu_head, native_forward,
                                                 env.native_form(), env.cpu_head()))
    stored = _stored_weights(path, in_place, explicit_forms)
    # Read in place, the folder's own weights stay lazy: never read, they take no memory.
    model, loaded_config = load_mlx_model(
        path, lazy=stored is not None, model_config=overrides,
        **({} if classes is None else {"get_model_classes": classes}))
    if tokenizer is None:
        tokenizer = load_tokenizer(path, eos_token_ids=loaded_config.get("eos_token_id"))
    prepare_for_backend(model, dtype, cpu_head, native_forward, stored, fuse_projections)
    from rewind.kernels.native_forward import native_forward as installed_forward
    from rewind.models.fused_projections import fused_in

    in_place_now = stored is not None and getattr(installed_forward(model), "form", "") == "gguf"
    materialize_constants(model, parameters=not in_place_now)
    release_free_heap()  # parsing tokenizer.json left ~180 MB of free heap mapped
    # Weights other than the folder's give other answers: their cache records must not mix.
    form = "|gguf" if in_place_now else ("|int8" if "int8" in (native_forward, cpu_head) else "")
    if fused_in(model):  # one product for sibling projections may round otherwise
        form += "|fused"
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=name_or_path,
                       config=config, fingerprint=model_fingerprint(path) + form)
