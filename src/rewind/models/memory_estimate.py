"""What a model will take in memory, before it is loaded: weights from the files' headers, KV
caches from the config's shapes.

Estimates, not measurements: the pool replaces the weights' figure with the bytes the loaded
arrays hold (ModelPool measures them), and the KV figure follows mlx-lm's caches (256-token
steps; sliding-window layers stop at their window; linear-attention layers hold one state).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2,
                "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
KV_STEP = 256  # mlx-lm's RotatingKVCache grows its buffers in steps of this many tokens


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (names -> dtype, shape, offsets); {} if unreadable."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 << 20:
                return {}
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error):
        return {}
    return header if isinstance(header, dict) else {}


def _elements(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


@dataclass(frozen=True)
class WeightsInfo:
    file_bytes: int
    params: int  # logical parameters (packed quantized weights counted unpacked)
    stored_float_bytes: int  # bytes per float parameter as stored (2 for bf16, 4 for f32)
    quantized: bool


def weights_info(folder: Path, config: dict[str, Any]) -> WeightsInfo:
    quant = config.get("quantization") or {}
    bits = int(quant.get("bits", 0)) if isinstance(quant, dict) else 0
    file_bytes = params = 0
    float_bytes = 2
    for weights in sorted(folder.glob("*.safetensors")):
        file_bytes += weights.stat().st_size
        header = safetensors_header(weights)
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            dtype, elements = info.get("dtype", ""), _elements(info.get("shape", []))
            if name.endswith((".scales", ".biases")) and bits:
                continue  # quantization metadata, not parameters
            if dtype == "U32" and bits:
                params += elements * 32 // bits
            else:
                params += elements
                if dtype == "F32":
                    float_bytes = 4
    return WeightsInfo(file_bytes, params, float_bytes, bool(bits))


def resident_weight_bytes(info: WeightsInfo, backend: str) -> int:
    """Bytes the loaded weights hold on `backend` (rewind.models.loader.prepare_for_backend):
    CPU: bf16 weights are read in place by the C kernels (quantized forms are dequantized to
    bf16 there, float32 stays float32); GPU: floats become bf16, quantized layers stay packed."""
    if backend == "cpu":
        return info.params * info.stored_float_bytes
    if info.quantized:
        return info.file_bytes
    return info.params * 2


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


@dataclass(frozen=True)
class KvShape:
    """Per-sequence cache bytes as a function of its tokens."""

    full_layers: int
    window_layers: int
    window: int
    linear_layers: int
    token_bytes: int  # one token's K and V in one attention layer
    state_bytes: int  # one linear-attention layer's recurrent and conv state

    def bytes_for(self, tokens: int) -> int:
        # Full-attention buffers hold the capacity ladder's rows (rewind.cache.kv allocates
        # them so); sliding windows are mlx-lm's, grown KV_STEP rows at a time up to the window.
        # Imported here: the rewind.cache package imports MLX, which this module does not need.
        from rewind.cache.capacity import capacity_for

        full = capacity_for(tokens)
        held = -(-max(tokens, 1) // KV_STEP) * KV_STEP
        return (self.full_layers * full * self.token_bytes
                + self.window_layers * min(held, self.window) * self.token_bytes
                + self.linear_layers * self.state_bytes)


def _layer_kinds(text: dict[str, Any], layers: int) -> list[str]:
    kinds = text.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        return [str(kind) for kind in kinds]
    if text.get("full_attention_interval"):  # Qwen 3.5 / Qwen3-Next: linear, full every n-th
        every = int(text["full_attention_interval"])
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(layers)]
    pattern = text.get("sliding_window_pattern")
    if pattern and text.get("sliding_window"):  # Gemma 3: full attention every n-th layer
        every = int(pattern)
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                for i in range(layers)]
    return ["full_attention"] * layers


def kv_shape(config: dict[str, Any], element_bytes: int) -> KvShape:
    text = _text_config(config)
    layers = int(text.get("num_hidden_layers") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads))
    kinds = _layer_kinds(text, layers)
    window = int(text.get("sliding_window") or 0)
    state = 0
    if "linear_attention" in kinds:
        value_heads = int(text.get("linear_num_value_heads") or kv_heads)
        key_dim = int(text.get("linear_key_head_dim") or head_dim)
        value_dim = int(text.get("linear_value_head_dim") or head_dim)
        key_heads = int(text.get("linear_num_key_heads") or value_heads)
        conv = int(text.get("linear_conv_kernel_dim") or 4)
        state = (value_heads * key_dim * value_dim
                 + (conv - 1) * (2 * key_heads * key_dim + value_heads * value_dim)) * 4
    return KvShape(full_layers=sum(kind == "full_attention" for kind in kinds),
                   window_layers=sum(kind == "sliding_attention" for kind in kinds) if window
                   else 0,
                   window=window,
                   linear_layers=sum(kind == "linear_attention" for kind in kinds),
                   token_bytes=2 * kv_heads * head_dim * element_bytes,
                   state_bytes=state)


@dataclass(frozen=True)
class ModelNeed:
    weights_bytes: int
    kv: KvShape
    reserve_tokens: int  # KV tokens reserved per slot at load time
    parallel: int

    @property
    def reserve_bytes(self) -> int:
        return self.parallel * self.kv.bytes_for(self.reserve_tokens)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.reserve_bytes


def estimate_need(path: Path, backend: str, parallel: int, reserve_tokens: int,
                  context: int | None) -> ModelNeed:
    """A model folder's need at `parallel` slots of `reserve_tokens` each (at most its context).
    A GGUF file (converted on load to bf16) counts its file size twice, for the bf16 form."""
    if path.is_file():
        return ModelNeed(path.stat().st_size * 2, KvShape(0, 0, 0, 0, 0, 0), 0, parallel)
    config = json.loads((path / "config.json").read_text())
    info = weights_info(path, config)
    element_bytes = 4 if backend == "cpu" else 2
    tokens = min(reserve_tokens, context) if context else reserve_tokens
    return ModelNeed(resident_weight_bytes(info, backend), kv_shape(config, element_bytes),
                     tokens, parallel)


def loaded_bytes(model: Any) -> int:
    """Bytes the loaded model's arrays hold: its parameters and any array its modules keep
    beside them (a C head's int8 copy, RoPE tables)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from rewind.kernels.native_forward import native_forward

    forward = native_forward(model)
    if forward is not None and forward.form == "gguf":
        # Read in place from the GGUF: the model's own arrays stay lazy and are never read.
        return int(forward.nbytes) + kernel_copy_bytes(model)
    seen: set[int] = set()
    total = 0
    arrays = [value for _, value in tree_flatten(model.parameters())]
    arrays += [value for module in model.modules() for value in module.values()
               if isinstance(value, mx.array)]
    for array in arrays:
        if id(array) not in seen:
            seen.add(id(array))
            total += array.nbytes
    return total + kernel_copy_bytes(model)


def kernel_copy_bytes(model: Any) -> int:
    """Bytes the CPU kernels hold in NumPy beside the model's arrays: the C head's bf16 / int8
    copy (~0.31 GiB for a float32 Gemma 3's head) and the native forward's int8 or float32
    weights (its bf16 form reads the model's own arrays in place: nothing of its own)."""
    from rewind.kernels.fast_head import fast_head
    from rewind.kernels.native_forward import native_forward

    head, forward = fast_head(model), native_forward(model)
    held = int(head.own_bytes) if head is not None else 0
    if forward is not None and forward.form not in ("bf16", "gguf"):
        held += int(forward.nbytes)
    return held
