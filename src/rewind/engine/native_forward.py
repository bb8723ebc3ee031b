"""Decode steps on the CPU through Rewind's C kernels, with attention and the caches left to MLX.

Why: a decode step of a small model on a CPU is bound by two things MLX's CPU backend does
poorly. Weights: MLX reads them as float32 (its bf16 and quantized matmuls are slower still), so
Gemma 3 270M's layers cost 400 MB per token where the bf16 checkpoint holds 200 MB. Graph
overhead: ~40 nodes per layer at tens of microseconds each, about half the step. Here each layer
is two C calls (rewind/native/cpu_kernels.c: norms, the stacked q/k/v projection, q/k norms and
RoPE; then the output projection, residuals and the MLP) around a handful of MLX ops that do
what must stay MLX: `cache.update_and_fetch` and `scaled_dot_product_attention` with the model's
own masks. So every cache class (KVCache, RotatingKVCache, their batch forms for continuous
batching, quantized KV), the prompt cache's snapshots and restores, and trimming all work
unchanged, and the caches hold exactly what the MLX path would put there.

Weights are copied once at load into the form the kernels read: bf16 when every layer weight is
exactly bf16 (a bf16 checkpoint, as the default model: the products are then the same as the
float32 path's, up to summation order), float32 otherwise, or int8 with one scale per output row
when asked for (REWIND_NATIVE_DECODE=int8: half the bytes again, at a measured quality cost).

Families: the mlx-lm backbones whose layer is exactly "norm, attention, residual, norm, gated
MLP, residual" with plain RoPE: gemma3_text (Gemma 3, with its extra norms and 1 + w weights),
llama, qwen2 (q/k/v biases) and qwen3 (q/k norms); biases anywhere are added after their
projection. Anything else (other RoPE variants, MoE,
linear attention, input embeddings for images) keeps MLX's path; `build` returns None for it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from rewind.engine import native

log = logging.getLogger(__name__)

ENV = "REWIND_NATIVE_DECODE"  # auto | bf16 | f32 | int8 | off
DEFAULT_FORM = "auto"
WEIGHT_FORMS = ("auto", "bf16", "f32", "int8", "off")


class Unsupported(ValueError):
    """The model (or one of its layers) is not one the kernels implement."""


@dataclass
class _Family:
    gemma: bool  # 1 + w norm weights, post-attention / post-MLP norms, scaled embeddings, GELU


def _family(backbone: Any) -> _Family:
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    if isinstance(backbone, gemma3_text.Gemma3Model):
        return _Family(gemma=True)
    if isinstance(backbone, (llama.LlamaModel, qwen2.Qwen2Model, qwen3.Qwen3Model)):
        return _Family(gemma=False)
    raise Unsupported(f"no native decode for {type(backbone).__name__}")


def _linear_weight(module: Any, what: str) -> tuple[mx.array, mx.array | None]:
    if not isinstance(module, nn.Linear) or "scales" in module:
        raise Unsupported(f"{what} is not a float Linear ({type(module).__name__})")
    return module.weight, module.get("bias") if "bias" in module else None


def _is_bf16_exact(arrays: list[mx.array]) -> bool:
    for array in arrays:
        if array.dtype == mx.bfloat16:
            continue
        if not bool(mx.array_equal(array, array.astype(mx.bfloat16).astype(array.dtype)).item()):
            return False
    return True


class _Matrix:
    """One stacked weight in the kernels' form, kept alive with its ctypes view."""

    def __init__(self, parts: list[mx.array], biases: list[mx.array | None], form: str) -> None:
        weight = mx.concatenate([p.astype(mx.float32) for p in parts], axis=0)
        self.rows, self.cols = weight.shape
        self.scale: np.ndarray | None = None
        if form == "bf16":
            self.weight = np.array(weight.astype(mx.bfloat16).view(mx.uint16))
        elif form == "int8":
            scale = mx.maximum(mx.abs(weight).max(axis=1), 1e-12) / 127.0
            self.weight = np.array(mx.clip(mx.round(weight / scale[:, None]), -127, 127)
                                   .astype(mx.int8))
            self.scale = np.ascontiguousarray(np.array(scale), dtype=np.float32)
        else:
            self.weight = np.array(weight)
        self.weight = np.ascontiguousarray(self.weight)
        self.bias: np.ndarray | None = None
        if any(b is not None for b in biases):
            filled = [b if b is not None else mx.zeros((p.shape[0],))
                      for p, b in zip(parts, biases)]
            self.bias = np.ascontiguousarray(
                np.array(mx.concatenate([b.astype(mx.float32) for b in filled])))
        self.struct = native.Matrix(self.weight.ctypes.data,
                                    None if self.scale is None else self.scale.ctypes.data,
                                    None if self.bias is None else self.bias.ctypes.data,
                                    native.FORMS[form])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.weight, self.scale, self.bias) if a is not None)


def _vector(weight: mx.array | None, plus_one: bool) -> np.ndarray | None:
    if weight is None:
        return None
    value = weight.astype(mx.float32)
    return np.ascontiguousarray(np.array(value + 1.0 if plus_one else value))


def _pointer(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


class _NativeLayer:
    def __init__(self, block: Any, family: _Family, form: str, threads: int) -> None:
        attn, mlp = block.self_attn, block.mlp
        rope = attn.rope
        if type(rope) is not nn.RoPE:
            raise Unsupported(f"RoPE variant {type(rope).__name__}")
        weights = {name: _linear_weight(getattr(attn, name), name)
                   for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        weights.update({name: _linear_weight(getattr(mlp, name), name)
                        for name in ("gate_proj", "up_proj", "down_proj")})
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = weights["q_proj"][0].shape[0] // self.heads
        self.hidden = weights["q_proj"][0].shape[1]
        self.intermediate = weights["gate_proj"][0].shape[0]
        self.scale = float(attn.scale)
        plus_one = family.gemma
        eps = float(block.input_layernorm.eps)
        if family.gemma:
            post_attn, pre_ff = block.post_attention_layernorm, block.pre_feedforward_layernorm
            post_ff = block.post_feedforward_layernorm
            self.sliding = bool(attn.is_sliding)
        else:
            post_attn, pre_ff, post_ff = None, block.post_attention_layernorm, None
            self.sliding = bool(getattr(block, "use_sliding", False))
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)

        self.qkv = _Matrix([weights[n][0] for n in ("q_proj", "k_proj", "v_proj")],
                           [weights[n][1] for n in ("q_proj", "k_proj", "v_proj")], form)
        self.o = _Matrix([weights["o_proj"][0]], [weights["o_proj"][1]], form)
        self.gate_up = _Matrix([weights["gate_proj"][0], weights["up_proj"][0]],
                               [weights["gate_proj"][1], weights["up_proj"][1]], form)
        self.down = _Matrix([weights["down_proj"][0]], [weights["down_proj"][1]], form)
        self.vectors = {
            "input_norm": _vector(block.input_layernorm.weight, plus_one),
            "q_norm": _vector(None if q_norm is None else q_norm.weight, plus_one),
            "k_norm": _vector(None if k_norm is None else k_norm.weight, plus_one),
            "post_attn_norm": _vector(None if post_attn is None else post_attn.weight, plus_one),
            "pre_ff_norm": _vector(pre_ff.weight, plus_one),
            "post_ff_norm": _vector(None if post_ff is None else post_ff.weight, plus_one),
        }
        v = {name: _pointer(array) for name, array in self.vectors.items()}
        self.struct = native.Layer(v["input_norm"], self.qkv.struct, v["q_norm"], v["k_norm"],
                                   self.o.struct, v["post_attn_norm"], v["pre_ff_norm"],
                                   self.gate_up.struct, self.down.struct, v["post_ff_norm"])
        # mx.fast.rope's own frequencies (its CPU path computes exp(-i * log(base) / (dims / 2))
        # in float32): the same float32 angles, so positions far into a long context agree.
        dims, half = int(rope.dims), int(rope.dims) // 2
        self.inv_freq = np.ascontiguousarray(np.array(
            mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(float(rope.base)) / half))),
            dtype=np.float32)
        activation = native.ACT_GELU_TANH if family.gemma else native.ACT_SILU
        self.shape = native.Shape(self.hidden, self.heads, self.kv_heads, self.head_dim,
                                  self.intermediate, dims, activation, threads, eps,
                                  float(rope.scale), int(bool(rope.traditional)))
        self.width = (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (self.qkv, self.o, self.gate_up, self.down))


class NativeDecoder:
    """hidden = decoder.hidden(tokens [B, 1], cache): the backbone's output for one decode step,
    as float32 NumPy [B, hidden], with `cache` advanced exactly as the MLX path would."""

    def __init__(self, backbone: Any, form: str, kernels: ctypes.CDLL,
                 threads: int | None = None) -> None:
        family = _family(backbone)
        self.form = form
        self._kernels = kernels
        self._backbone = backbone
        threads = threads or native.kernel_threads()
        self.layers = [_NativeLayer(block, family, form, threads) for block in backbone.layers]
        first = self.layers[0]
        self.hidden_size = first.hidden
        self.norm = _vector(backbone.norm.weight, family.gemma)
        self.eps = float(backbone.norm.eps)
        self.embed_scale: mx.array | None = None
        if family.gemma:
            self.embed_scale = mx.array(backbone.args.hidden_size ** 0.5, mx.bfloat16)
            self.window = backbone.window_size
        else:
            self.window = getattr(backbone, "sliding_window", None)
        self.dtype = backbone.embed_tokens.weight.dtype  # what the caches hold
        self._scratch: dict[int, tuple[np.ndarray, ...]] = {}

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def _buffers(self, rows: int) -> tuple[np.ndarray, ...]:
        if rows not in self._scratch:
            widest = max(layer.width for layer in self.layers)
            scratch = max(self.hidden_size + 3 * layer.intermediate for layer in self.layers)
            self._scratch[rows] = (np.empty((rows, widest), np.float32),
                                   np.empty((rows, scratch), np.float32),
                                   np.empty((rows, self.hidden_size), np.float32))
        return self._scratch[rows]

    def _masks(self, rows: int, cache: list[Any]) -> dict[bool, Any]:
        from mlx_lm.models.base import create_attention_mask

        shape_only = mx.zeros((rows, 1, 1))
        masks: dict[bool, Any] = {}
        for layer, layer_cache in zip(self.layers, cache):
            if layer.sliding not in masks:
                window = self.window if layer.sliding else None
                masks[layer.sliding] = create_attention_mask(shape_only, layer_cache,
                                                             window_size=window)
        return masks

    def hidden(self, tokens: mx.array, cache: list[Any]) -> np.ndarray:
        from mlx_lm.models.base import scaled_dot_product_attention

        rows = tokens.shape[0]
        embedded = self._backbone.embed_tokens(tokens.reshape(rows))
        if self.embed_scale is not None:
            embedded = embedded * self.embed_scale.astype(embedded.dtype)
        x = np.array(embedded.astype(mx.float32))  # a fresh, writable copy
        qkv, scratch, _ = self._buffers(rows)
        masks = self._masks(rows, cache)
        offset = cache[0].offset
        positions = np.ascontiguousarray(
            np.broadcast_to(np.array(offset, dtype=np.int64).reshape(-1), (rows,)))
        k = self._kernels
        for layer, layer_cache in zip(self.layers, cache):
            status = k.layer_pre(ctypes.byref(layer.struct), ctypes.byref(layer.shape),
                                 x.ctypes.data, rows, positions.ctypes.data,
                                 layer.inv_freq.ctypes.data, qkv.ctypes.data, scratch.ctypes.data)
            if status:
                raise RuntimeError(f"layer_pre failed with status {status}")
            heads, kv, dim = layer.heads, layer.kv_heads, layer.head_dim
            out = qkv[:, :layer.width]
            queries = mx.array(out[:, :heads * dim], self.dtype).reshape(rows, heads, 1, dim)
            keys = mx.array(out[:, heads * dim:(heads + kv) * dim],
                            self.dtype).reshape(rows, kv, 1, dim)
            values = mx.array(out[:, (heads + kv) * dim:], self.dtype).reshape(rows, kv, 1, dim)
            keys, values = layer_cache.update_and_fetch(keys, values)
            attended = scaled_dot_product_attention(queries, keys, values, cache=layer_cache,
                                                    scale=layer.scale, mask=masks[layer.sliding])
            attended = attended.reshape(rows, heads * dim).astype(mx.float32)
            mx.eval(attended)
            attended_np = np.ascontiguousarray(np.array(attended, copy=False))
            status = k.layer_post(ctypes.byref(layer.struct), ctypes.byref(layer.shape),
                                  x.ctypes.data, rows, attended_np.ctypes.data,
                                  scratch.ctypes.data)
            if status:
                raise RuntimeError(f"layer_post failed with status {status}")
        normed = np.empty_like(x)
        k.rows_rms_norm(x.ctypes.data, self.norm.ctypes.data, self.eps, rows, self.hidden_size,
                        normed.ctypes.data)
        return normed


def choose_form(backbone: Any, form: str) -> str:
    """"auto" -> bf16 when every layer weight is bf16-exact (the answer does not change), else
    f32; any other form as given."""
    if form != "auto":
        return form
    from mlx.utils import tree_flatten

    weights = [value for block in backbone.layers for module in (block.self_attn, block.mlp)
               for _, value in tree_flatten(module.parameters()) if value.ndim == 2]
    return "bf16" if _is_bf16_exact(weights) else "f32"


def install_native_decoder(model: Any, form: str | None = None) -> NativeDecoder | None:
    """Give `model` a NativeDecoder used by rewind.engine.forward for one-token steps; None when
    the kernels or the family are not available (MLX's path then runs, with the same answers)."""
    from rewind.engine.forward import split_model

    form = form or os.environ.get(ENV) or DEFAULT_FORM
    if form == "off":
        return None
    if form not in WEIGHT_FORMS:
        raise ValueError(f"{ENV}={form!r}: expected one of {', '.join(WEIGHT_FORMS)}")
    kernels = native.load_kernels()
    split = split_model(model)
    if kernels is None or split is None:
        return None
    try:
        _family(split.backbone)  # before looking at layers: other families have other modules
        decoder = NativeDecoder(split.backbone, choose_form(split.backbone, form), kernels)
    except Unsupported as exc:
        log.info("native decode not used: %s", exc)
        return None
    object.__setattr__(model, "_rewind_native_decoder", decoder)  # outside the parameter tree
    return decoder


def native_decoder(model: Any) -> NativeDecoder | None:
    return model.__dict__.get("_rewind_native_decoder")


def remove_native_decoder(model: Any) -> None:
    model.__dict__.pop("_rewind_native_decoder", None)
