"""GGUF (llama.cpp) -> Hugging Face names, config and float weights that mlx-lm can load.

Three things llama.cpp's converter did that we undo here:
- tensor names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, etc.;
- for the `llama` architecture it permuted the rows of q_proj/k_proj (HF's rotate-half rope to
  GGML's interleaved one); mlx-lm's llama uses the HF layout, so we permute back;
- for Gemma it stored every RMSNorm weight as w + 1 (Gemma computes x * (1 + w)); mlx-lm's Gemma
  also applies (1 + w), so we subtract the 1 again (without it perplexity explodes; see
  tests/test_convert.py and benchmarks/results/convert.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from gguf import quants

from rewind.models.gguf_file import GgufError, GgufFile, GgufTensor

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
GEMMA_ARCHITECTURES = ("gemma3",)

# Per-layer names (after `blk.N.`) -> HF names (after `model.layers.N.`), shared by all supported archs.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; llama.cpp calls the pre-MLP one `ffn_norm`.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp writes that the HF model recomputes itself (rope frequency tables).
_DERIVED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def check_architecture(gguf: GgufFile) -> str:
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GgufError(f"{gguf.path}: architecture {arch!r} is not supported by rewind convert "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """The HF (mlx-lm) name of a llama.cpp tensor; GgufError names the tensor if it has none."""
    layer = _LAYER_PATTERN.match(gguf_name)
    if layer:
        index, short, kind = layer.groups()
        table = _GEMMA_LAYER_NAMES if arch in GEMMA_ARCHITECTURES else _LAYER_NAMES
        if short in table:
            return f"model.layers.{index}.{table[short]}.{kind}"
    else:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise GgufError(f"tensor {gguf_name!r} has no known Hugging Face name for architecture {arch!r}")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute(w, n_heads)` on q_proj/k_proj rows (llama arch only).

    llama.cpp: w.reshape(n_heads, 2, rows // n_heads // 2, ...).swapaxes(1, 2).reshape(w.shape)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def is_gemma_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


def fix_tensor(hf_name: str, weight: np.ndarray, arch: str, config: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's storage conventions for one float tensor (see the module docstring)."""
    if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
        return unpermute_rope_rows(weight, config["num_attention_heads"])
    if arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
        return unpermute_rope_rows(weight, config["num_key_value_heads"])
    if arch in GEMMA_ARCHITECTURES and is_gemma_norm(hf_name):
        return weight - 1.0
    return weight


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    """The HF config.json mlx-lm needs, from the GGUF metadata plus per-architecture defaults the
    GGUF does not carry."""
    arch = check_architecture(gguf)

    def need(key: str) -> Any:
        value = gguf.arch_value(key)
        if value is None:
            raise GgufError(f"{gguf.path}: metadata {arch}.{key} is missing")
        return value

    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    n_kv = gguf.arch_value("attention.head_count_kv", n_heads)
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab_size = int(gguf.arch_value("vocab_size") or (len(tokens) if tokens is not None else 0))
    if not vocab_size:
        raise GgufError(f"{gguf.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    head_dim = int(gguf.arch_value("attention.key_length") or hidden // n_heads)
    config: dict[str, Any] = {
        "architectures": [],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv if np.ndim(n_kv) == 0 else np.max(n_kv)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(gguf.arch_value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf.arch_value("context_length", 4096)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    rope_type = gguf.arch_value("rope.scaling.type")
    if rope_type in ("linear", "yarn"):
        config["rope_scaling"] = {"type": rope_type, "factor": float(gguf.arch_value("rope.scaling.factor", 1.0))}
        if rope_type == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                gguf.arch_value("rope.scaling.original_context_length", config["max_position_embeddings"]))
    if "rope_freqs.weight" in gguf.tensors:
        table = dequantized(gguf, gguf.tensors["rope_freqs.weight"])
        config["rope_scaling"] = llama3_rope_scaling(table, config["rope_theta"], head_dim, gguf.path)

    bos, eos = gguf.metadata.get("tokenizer.ggml.bos_token_id"), gguf.metadata.get("tokenizer.ggml.eos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos_ids = [int(eos)] if eos is not None else []

    if arch == "llama":
        config["architectures"] = ["LlamaForCausalLM"]
        config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in gguf.tensors
    elif arch == "qwen2":
        config["architectures"] = ["Qwen2ForCausalLM"]
    elif arch == "qwen3":
        config["architectures"] = ["Qwen3ForCausalLM"]
    elif arch == "gemma3":
        # The GGUF holds the text tower only: mlx-lm's `gemma3_text`.
        config.update(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            sliding_window=int(gguf.arch_value("attention.sliding_window", 512)),
            sliding_window_pattern=6,  # five local layers, then one global: not stored in the GGUF
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=head_dim,
            hidden_activation="gelu_pytorch_tanh",
        )
        tokens_list = list(tokens) if tokens is not None else []
        if "<end_of_turn>" in tokens_list:  # a chat turn ends here as well as at <eos>
            eos_ids.append(tokens_list.index("<end_of_turn>"))
    if eos_ids:
        config["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    return config


# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of every Llama 3.1 / 3.2 / 3.3.
_LLAMA3_ROPE_CANDIDATES = ((1.0, 4.0, 8192),)


def llama3_rope_factors(factor: float, low: float, high: float, original: int, base: float,
                        head_dim: int) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter writes as rope_freqs.weight (its
    LlamaModel.generate_extra_tensors), for HF's llama3 rope_scaling parameters."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelens = 2 * np.pi / freqs
    smooth = (original / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelens < original / high, 1.0, np.where(wavelens > original / low, factor, medium))


def llama3_rope_scaling(table: np.ndarray, base: float, head_dim: int, source: object = "") -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from llama.cpp's factor table: the GGUF keeps only the table,
    mlx-lm wants the parameters. Only an exact match is accepted; a guess would be subtly wrong."""
    factor = float(table.max())
    for low, high, original in _LLAMA3_ROPE_CANDIDATES:
        expected = llama3_rope_factors(factor, low, high, original, base, head_dim)
        if expected.shape == table.shape and np.allclose(expected, table, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise GgufError(f"{source}: tensor 'rope_freqs.weight' holds rope factors that match no known "
                    f"Llama 3 rope scaling (max factor {factor}); this file is not supported")


def dequantized(gguf: GgufFile, tensor: GgufTensor) -> np.ndarray:
    """The tensor as float32, through the `gguf` package's numpy dequantizer."""
    try:
        values = quants.dequantize(gguf.raw(tensor), tensor.qtype)
    except NotImplementedError as exc:
        raise GgufError(f"{gguf.path}: tensor {tensor.name!r} has type {tensor.qtype.name}, which "
                        f"the gguf package cannot dequantize") from exc
    values = np.asarray(values, dtype=np.float32).reshape(tensor.numpy_shape)
    if not np.isfinite(values).all():
        raise GgufError(f"{gguf.path}: tensor {tensor.name!r} holds NaN or infinite values: the file is corrupt")
    return values


def iter_hf_weights(gguf: GgufFile, config: dict[str, Any],
                    on_tensor: Callable[[str], None] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 weight) for every tensor, with llama.cpp's conventions undone."""
    arch = check_architecture(gguf)
    for tensor in gguf.tensors.values():
        if tensor.name in _DERIVED_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, arch)
        weight = fix_tensor(name, dequantized(gguf, tensor), arch, config)
        if on_tensor is not None:
            on_tensor(tensor.name)
        yield name, weight
