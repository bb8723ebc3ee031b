"""The backbone's forward pass on the CPU through Rewind's C kernels, for any number of tokens:
prefill chunks, decode steps and a continuous batch, with the KV caches left to MLX.

Why: MLX's CPU backend is slow for a small model in three ways. Weights: its bf16 and quantized
matmuls are slower than float32 through BLAS, so the model must be widened to float32 (Gemma 3
270M: 1.07 GB instead of the 536 MB checkpoint, read at 400 MB per decoded token). Graph
overhead: ~40 nodes per layer at tens of microseconds each, about half a decode step. Attention:
its CPU path materializes every score and runs a scalar exp. Here each layer is two C calls
(rewind/kernels/c/cpu_kernels.c: norms, the stacked q/k/v projection, q/k norms and RoPE; then the
output projection, residuals and the MLP), reading the checkpoint's bf16 weights in place, around
the KV-cache update, which stays MLX (`cache.update_and_fetch`), and attention through
rewind/kernels/c/attention.c. So every cache class (KVCache, RotatingKVCache, their batch forms,
quantized KV), the prompt cache's snapshots and restores, and trimming work unchanged, and the
caches hold float32 keys and values, as MLX's float32 path puts there.

How it is reached: `install_native_forward` swaps the backbone's class for a subclass whose
`__call__` is this forward pass, so every caller of the mlx-lm model (the engine, the prompt
cache's prefill, perplexity, mlx-lm's own generate) gets it; `remove_native_forward` swaps it
back.

Weights: bf16 when every layer weight is exactly bf16 (a bf16 checkpoint, as the default model:
the products are the float32 path's, up to summation order), float32 otherwise, or int8 with one
scale per output row when asked for (REWIND_NATIVE=int8: half the bytes again, at a measured
quality cost). In bf16 the stacked q/k/v and gate/up matrices are built once and the MLX modules'
weights become slices of them, so the checkpoint is held once.

Families: the mlx-lm backbones whose layer is exactly "norm, attention, residual, norm, gated
MLP, residual" with plain RoPE: gemma3_text (Gemma 3, with its extra norms, 1 + w weights and
scaled embeddings), llama, qwen2 (q/k/v biases) and qwen3 (q/k norms); biases anywhere are added
after their projection. Anything else (other RoPE variants, MoE, linear attention) keeps MLX's
path; `install_native_forward` returns None for it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from rewind.kernels import native
from rewind.kernels.boundary import (Kernels, KernelCallError, LayerArgs, MatrixArgs, StepArgs,
                                     StepCache)
from rewind.kernels.cpu_attention import (attention_into, decode_attention_into, mask_for_kernel,
                                          moved_as_foreseen, tail_layout)
from rewind.kernels.host_view import host_view
from rewind.kernels.model_split import forget_split, split_model
from rewind.kernels.object_table import ObjectTable
from rewind.kernels.rebind import computes_as
from rewind.kernels.stored import StoredMatrix, StoredWeights, kernel_form

log = logging.getLogger(__name__)

DEFAULT_FORM = "auto"
WEIGHT_FORMS = ("auto", "bf16", "f32", "int8", "off")  # REWIND_NATIVE's choices
# A GGUF's weights as stored (rewind.kernels.stored), blocks read by quant.c in place: chosen by
# the loader with the stored weights (--cpu-weights gguf), not by REWIND_NATIVE.
STORED_FORM = "gguf"
KV_DTYPE = mx.float32  # what the caches hold: the float32 path's keys and values


class Unsupported(ValueError):
    """The model (or one of its layers) is not one the kernels implement."""


@dataclass
class _Family:
    gemma: bool  # 1 + w norm weights, post-attention / post-MLP norms, scaled embeddings, GELU
    module: Any  # the mlx-lm model file: its Attention and MLP classes are the ones implemented


def _family(backbone: Any) -> _Family:
    """Exact classes only: a subclass (another model's) may compute differently; one of Rewind's
    own that computes the same is registered as standing in for it (rewind.kernels.rebind)."""
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    families = {gemma3_text.Gemma3Model: _Family(True, gemma3_text),
                llama.LlamaModel: _Family(False, llama), qwen2.Qwen2Model: _Family(False, qwen2),
                qwen3.Qwen3Model: _Family(False, qwen3)}
    family = families.get(type(backbone))
    if family is None:
        raise Unsupported(f"no native forward for {type(backbone).__name__}")
    for block in backbone.layers:
        for part, expected in ((block.self_attn, family.module.Attention),
                               (block.mlp, family.module.MLP)):
            if computes_as(type(part)) is not expected:
                raise Unsupported(f"{type(part).__name__} is not {family.module.__name__}'s "
                                  f"{expected.__name__}")
    return family


def _linear(module: Any, what: str) -> nn.Linear:
    if not isinstance(module, nn.Linear) or "scales" in module:
        raise Unsupported(f"{what} is not a float Linear ({type(module).__name__})")
    return module


def _is_bf16_exact(arrays: list[mx.array]) -> bool:
    for array in arrays:
        if array.dtype == mx.bfloat16:
            continue
        if not bool(mx.array_equal(array, array.astype(mx.bfloat16).astype(array.dtype)).item()):
            return False
    return True


class _Matrix:
    """Linear layers stacked along their outputs, in the kernels' form, as checked `MatrixArgs`
    (which own the arrays their struct points into)."""

    def __init__(self, modules: list[nn.Linear], form: str) -> None:
        parts = [m.weight for m in modules]
        self.scale: np.ndarray | None = None
        if form == "bf16" and all(p.dtype == mx.bfloat16 for p in parts):
            # Held once: the MLX modules' weights become slices of the stacked matrix.
            stacked = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
            self.weight = host_view(stacked)
            start = 0
            for module in modules:
                rows = module.weight.shape[0]
                module.weight = stacked[start:start + rows]
                start += rows
            mx.eval([m.weight for m in modules])
        elif form == "int8":
            self.weight, self.scale = native.int8_rows(
                mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0])
        else:
            weight = mx.concatenate([p.astype(mx.float32) for p in parts], axis=0)
            if form == "bf16":
                self.weight = np.array(weight.astype(mx.bfloat16).view(mx.uint16))
            else:
                self.weight = np.array(weight)
        self.weight = np.ascontiguousarray(self.weight)
        self.rows, self.cols = self.weight.shape
        self.bias: np.ndarray | None = None
        biases = [m.bias if "bias" in m else None for m in modules]
        if any(b is not None for b in biases):
            filled = [b if b is not None else mx.zeros((m.weight.shape[0],))
                      for m, b in zip(modules, biases)]
            self.bias = np.ascontiguousarray(
                np.array(mx.concatenate([b.astype(mx.float32) for b in filled])))
        self.args = MatrixArgs.build(self.weight, native.FORMS[form], self.scale, self.bias)

    @property
    def nbytes(self) -> int:
        return self.args.nbytes


class _StoredMatrix(_Matrix):
    """Stored weights stacked along their outputs, each read in place as its own part (no copy:
    a layer's q, k and v may each be stored in another type)."""

    def __init__(self, parts: list[StoredMatrix], biases: list[np.ndarray | None]) -> None:
        self.scale = None
        self.rows, self.cols = sum(part.rows for part in parts), parts[0].cols
        if any(part.cols != self.cols for part in parts):
            raise Unsupported("stacked weights of different widths")
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = np.ascontiguousarray(np.concatenate(
                [b if b is not None else np.zeros(part.rows, np.float32)
                 for part, b in zip(parts, biases)]), dtype=np.float32)
        try:
            self.args = MatrixArgs.stack([(part.data, kernel_form(part.ggml_type), None)
                                          for part in parts], self.cols, self.bias)
        except (KeyError, ValueError) as exc:
            raise Unsupported(f"stored weights: {exc}") from exc
        self.weight = parts[0].data


class InPlaceEmbedding(nn.Module):
    """The embedding module of a model read in place: rows of the stored table as float32
    (blocks dequantized by the kernels) and, as `as_linear`, the tied head's product over the
    same blocks. It replaces mlx-lm's `nn.Embedding`, so every caller of the model (the engine,
    perplexity, mlx-lm's generate) reads the file's table, and the model's own lazy table is
    never read."""

    def __init__(self, table: StoredMatrix, kernels: Kernels) -> None:
        super().__init__()
        # Outside the parameter tree (leading underscores): nothing here is an MLX parameter.
        self._table, self._kernels = table, kernels
        self._form = kernel_form(table.ggml_type)
        self._matrix = MatrixArgs.build(table.data, self._form, cols=table.cols)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def __call__(self, inputs: mx.array) -> mx.array:
        return mx.array(self.rows(inputs)).reshape(*inputs.shape, self._table.cols)

    def rows(self, inputs: mx.array) -> np.ndarray:
        """The embeddings of `inputs`' ids, one float32 row each, in a new array."""
        ids = np.ascontiguousarray(np.array(inputs, dtype=np.int64).reshape(-1))
        table = self._table
        if self._form >= native.FORM_GGML:
            rows = np.empty((ids.shape[0], table.cols), np.float32)
            self._kernels.dequantize_rows(table.data, self._form, table.cols, ids, rows)
        elif self._form == native.FORM_BF16:
            rows = (table.data[ids].astype(np.uint32) << 16).view(np.float32)
        else:
            rows = table.data[ids]
        return rows

    def as_linear(self, x: mx.array) -> mx.array:
        return _product(self._kernels, self._matrix, x)


class InPlaceLinear(nn.Module):
    """y = x @ W^T with W a stored matrix read in place (a GGUF's untied output head)."""

    def __init__(self, matrix: StoredMatrix, kernels: Kernels) -> None:
        super().__init__()
        self._stored, self._kernels = matrix, kernels
        self._matrix = MatrixArgs.build(matrix.data, kernel_form(matrix.ggml_type),
                                        cols=matrix.cols)

    @property
    def nbytes(self) -> int:
        return self._stored.nbytes

    def __call__(self, x: mx.array) -> mx.array:
        return _product(self._kernels, self._matrix, x)


def _product(kernels: Kernels, matrix: MatrixArgs, x: mx.array) -> mx.array:
    lead = x.shape[:-1]
    rows = np.ascontiguousarray(np.array(x.reshape(-1, matrix.cols).astype(mx.float32)))
    out = np.empty((rows.shape[0], matrix.rows), np.float32)
    kernels.matvec(matrix, rows, out, native.kernel_threads())
    return mx.array(out).reshape(*lead, matrix.rows)


def _vector(weight: mx.array | None, plus_one: bool) -> np.ndarray | None:
    if weight is None:
        return None
    value = weight.astype(mx.float32)
    return np.ascontiguousarray(np.array(value + 1.0 if plus_one else value))


def _rope_frequencies(rope: Any) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dims / 2] float32, position scale) of a rope module: the angles
    mx.fast.rope computes for it."""
    if type(rope) is nn.RoPE:
        # mx.fast.rope's own frequencies (its CPU path computes exp(-i * log(base) / (dims / 2))
        # in float32): the same float32 angles, so positions far into a long context agree.
        half = int(rope.dims) // 2
        exponents = mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(float(rope.base)) / half)
        return np.ascontiguousarray(np.array(mx.exp(exponents)), dtype=np.float32), float(rope.scale)
    from mlx_lm.models.rope_utils import Llama3RoPE

    if type(rope) is Llama3RoPE:
        # Llama 3.1+ rope scaling: mx.fast.rope with explicit periods `_freqs` and scale 1.
        periods = rope._freqs.astype(mx.float32)
        return np.ascontiguousarray(np.array(1.0 / periods), dtype=np.float32), 1.0
    raise Unsupported(f"RoPE variant {type(rope).__name__}")


class _NativeLayer:
    def __init__(self, block: Any, family: _Family, form: str, threads: int,
                 stored: StoredWeights | None = None, index: int = 0) -> None:
        attn, mlp = block.self_attn, block.mlp
        rope = attn.rope
        self.inv_freq, rope_scale = _rope_frequencies(rope)
        linears = {name: _linear(getattr(attn, name), name)
                   for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        linears.update({name: _linear(getattr(mlp, name), name)
                        for name in ("gate_proj", "up_proj", "down_proj")})
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = linears["q_proj"].weight.shape[0] // self.heads
        self.hidden = linears["q_proj"].weight.shape[1]
        self.intermediate = linears["gate_proj"].weight.shape[0]
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

        if stored is None:
            self.qkv = _Matrix([linears[n] for n in ("q_proj", "k_proj", "v_proj")], form)
            self.o = _Matrix([linears["o_proj"]], form)
            self.gate_up = _Matrix([linears["gate_proj"], linears["up_proj"]], form)
            self.down = _Matrix([linears["down_proj"]], form)
            self.vectors = {
                "input_norm": _vector(block.input_layernorm.weight, plus_one),
                "q_norm": _vector(None if q_norm is None else q_norm.weight, plus_one),
                "k_norm": _vector(None if k_norm is None else k_norm.weight, plus_one),
                "post_attn_norm": _vector(None if post_attn is None else post_attn.weight,
                                          plus_one),
                "pre_ff_norm": _vector(pre_ff.weight, plus_one),
                "post_ff_norm": _vector(None if post_ff is None else post_ff.weight, plus_one),
            }
        else:
            self._from_stored(stored, f"model.layers.{index}.", family)
        dims = int(rope.dims)
        traditional = bool(rope.traditional)
        if stored is not None and stored.interleaved_rope:
            traditional = not traditional  # q/k rows in GGML's layout: the same attention
        dims = int(rope.dims)
        activation = native.ACT_GELU_TANH if family.gemma else native.ACT_SILU
        shape = native.Shape(self.hidden, self.heads, self.kv_heads, self.head_dim,
                             self.intermediate, dims, activation, threads, eps,
                             rope_scale, int(traditional))
        matrices = {"qkv": self.qkv.args, "o": self.o.args, "gate_up": self.gate_up.args,
                    "down": self.down.args}
        self.args = LayerArgs.build(shape, self.vectors, matrices, self.inv_freq)
        self.width = self.args.width

    def _from_stored(self, stored: StoredWeights, prefix: str, family: _Family) -> None:
        if stored.norms_plus_one != family.gemma:
            raise Unsupported("stored norm weights in another convention than the family's")

        def matrix(*names: str) -> _StoredMatrix:
            try:
                parts = [stored.matrices[prefix + name] for name in names]
            except KeyError as exc:
                raise Unsupported(f"stored weights have no {exc}") from exc
            return _StoredMatrix(parts, [stored.vectors.get(f"{prefix}{name}.bias")
                                         for name in names])

        self.qkv = matrix("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.o = matrix("self_attn.o_proj")
        self.gate_up = matrix("mlp.gate_proj", "mlp.up_proj")
        self.down = matrix("mlp.down_proj")
        if family.gemma:
            names = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                     "pre_ff_norm": "pre_feedforward_layernorm",
                     "post_ff_norm": "post_feedforward_layernorm"}
        else:
            names = {"input_norm": "input_layernorm", "pre_ff_norm": "post_attention_layernorm"}
        names.update({"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"})
        self.vectors = {key: stored.vectors.get(prefix + name) for key, name in names.items()}
        self.vectors.setdefault("post_attn_norm", None)
        self.vectors.setdefault("post_ff_norm", None)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (self.qkv, self.o, self.gate_up, self.down))


def _offsets(cache: list[Any] | None, batch: int) -> np.ndarray:
    """Each row's position before this call: a cache's offset (an int, or one per row in the
    batch cache classes), 0 without a cache."""
    if not cache or cache[0] is None:
        return np.zeros(batch, np.int64)
    offset = cache[0].offset
    value = np.array(offset, dtype=np.int64).reshape(-1)
    return np.ascontiguousarray(np.broadcast_to(value, (batch,)))


@dataclass
class RowsInFlight:
    """A block of token rows part-way through the layers: a prompt chunk whose layers are spread
    over several engine steps, so each step stays short next to the decoding rows."""

    cache: list[Any] | None
    batch: int
    length: int
    x: np.ndarray  # [batch * length, hidden] float32: the rows after `done` layers
    masks: dict[bool, Any]  # full-attention and sliding-window masks, as of the block's start
    positions: np.ndarray  # [batch * length] int64 rotary positions
    done: int = 0  # layers passed

    @property
    def rows(self) -> int:
        return self.batch * self.length


def _scatter(x: np.ndarray, blocks: list[RowsInFlight]) -> None:
    """Copy the rows of several blocks, computed together in `x`, back into each block."""
    if len(blocks) == 1 and blocks[0].x is x:
        return
    first = 0
    for block in blocks:
        block.x[...] = x[first:first + block.rows]
        first += block.rows


class NativeForward:
    """forward(inputs [B, L], cache, input_embeddings) -> the backbone's output [B, L, hidden]
    (final norm applied), float32, with `cache` advanced exactly as the MLX path would."""

    def __init__(self, backbone: Any, form: str, kernels: Kernels,
                 threads: int | None = None, stored: StoredWeights | None = None) -> None:
        family = _family(backbone)
        self.form = form
        self._kernels = kernels
        threads = threads or native.kernel_threads()
        self.layers = [_NativeLayer(block, family, form, threads, stored, index)
                       for index, block in enumerate(backbone.layers)]
        self.hidden_size = self.layers[0].hidden
        self.stored_bytes = 0  # bytes of the stored weights read in place beside the layers'
        self.stored_types = "" if stored is None else ", ".join(
            f"{name} x{count}" for name, count in stored.types().items())
        # The stored table, whose rows `begin` looks up in NumPy, and Gemma's float32 scale.
        self._stored_embed: InPlaceEmbedding | None = None
        self._stored_scale: np.float32 | None = None
        if stored is None:
            # The embedding module, not the backbone: the backend's table maps the backbone to
            # this object, and a reference back would keep every unloaded model alive.
            self._embed: Any = backbone.embed_tokens
            self.norm = _vector(backbone.norm.weight, family.gemma)
        else:
            norm = stored.vectors.get("model.norm")
            if not isinstance(backbone.embed_tokens, InPlaceEmbedding) or norm is None:
                raise Unsupported("stored weights without their embedding module or final norm")
            self._embed = self._stored_embed = backbone.embed_tokens
            self.norm = norm
            self.stored_bytes = backbone.embed_tokens.nbytes
        self.eps = float(backbone.norm.eps)
        self.embed_scale: mx.array | None = None
        if family.gemma:
            # mlx-lm (as Hugging Face) scales by sqrt(hidden) rounded to bf16; llama.cpp, whose
            # weights the stored form runs, by the float32 value.
            scale = backbone.args.hidden_size ** 0.5
            self.embed_scale = (mx.array(scale, mx.float32) if stored is not None
                                else mx.array(scale, mx.bfloat16))
            if stored is not None:
                self._stored_scale = np.float32(scale)
            self.window = backbone.window_size
        else:
            self.window = getattr(backbone, "sliding_window", None)
        self._scratch: tuple[np.ndarray, ...] = ()
        self._step_qkv = np.empty(0, np.float32)
        # Steps in one C call (step.c: `_step_in_one_call`) where every layer has the same
        # widths; False runs every step a layer at a time (the same bits: tests compare them).
        self.step: StepArgs | None = None
        try:
            self.step = StepArgs.build([layer.args for layer in self.layers],
                                       [layer.scale for layer in self.layers])
        except KernelCallError:
            pass
        self.steps_in_one_call = self.step is not None
        self.one_call_steps = 0  # steps run in one call (tests check the path ran)
        # Writes a block of keys into a full sliding window in place, with what it overwrote
        # kept to give back (rewind.cache.window_blocks: takes_in_place, block_slots,
        # write_in_place), handed in by the engine's runner; None: the caches' own updates.
        self.block_writer: Any = None
        self.swapped: list[tuple[Any, str, Any]] = []  # modules replaced by in-place ones

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers) + self.stored_bytes

    def layer_costs(self, context: int) -> list[float]:
        """Each layer's work for one token at `context` tokens held, in units of a layer's mean
        matrix work: the matrix products plus attention over the keys it reads (a sliding
        layer's window at most). At 10k tokens a full-attention layer of Gemma 3 270M costs
        about 4x a sliding one, so a fixed count of layers a step would not bound the step."""
        matrix = [layer.hidden * (layer.width + 3 * layer.intermediate)
                  + layer.heads * layer.head_dim * layer.hidden for layer in self.layers]
        unit = sum(matrix) / len(matrix)
        costs = []
        for layer, work in zip(self.layers, matrix):
            keys = min(context, self.window) if layer.sliding and self.window else context
            costs.append((work + 2 * layer.heads * layer.head_dim * keys) / unit)
        return costs

    def _buffers(self, rows: int, layer: _NativeLayer) -> tuple[np.ndarray, ...]:
        """Work space for `rows` token rows of `layer`, each C-ordered in the layer's own widths
        (the kernels index them so): the projections [rows, width], the layer_post scratch
        [rows, hidden + 3 intermediate] and the attention output [rows, heads * head_dim].
        Flat buffers grown to the largest call and reused."""
        widths = (layer.width, self.hidden_size + 3 * layer.intermediate,
                  layer.heads * layer.head_dim)
        if not self._scratch or any(buffer.size < rows * width
                                    for buffer, width in zip(self._scratch, widths)):
            widest = (max(layer.width for layer in self.layers),
                      max(self.hidden_size + 3 * layer.intermediate for layer in self.layers),
                      max(layer.heads * layer.head_dim for layer in self.layers))
            self._scratch = tuple(np.empty(rows * width, np.float32) for width in widest)
        return tuple(buffer[:rows * width].reshape(rows, width)
                     for buffer, width in zip(self._scratch, widths))

    def _masks(self, batch: int, length: int, cache: list[Any] | None) -> dict[bool, Any]:
        """The masks mlx-lm's backbone would build: one for full attention, one for windows."""
        from mlx_lm.models.base import create_attention_mask

        shape_only = mx.zeros((batch, length, 1))
        masks: dict[bool, Any] = {}
        for index, layer in enumerate(self.layers):
            if layer.sliding not in masks:
                layer_cache = cache[index] if cache else None
                window = self.window if layer.sliding else None
                masks[layer.sliding] = create_attention_mask(shape_only, layer_cache,
                                                             window_size=window)
        return masks

    def _embeddings(self, inputs: mx.array, input_embeddings: mx.array | None) -> mx.array:
        if input_embeddings is not None:
            h = input_embeddings
        else:
            # Looked up in the stored dtype and widened: exact, as the float32 path's table.
            h = self._embed(inputs).astype(mx.float32)
        if self.embed_scale is not None:
            h = h * self.embed_scale.astype(h.dtype)
        return h.astype(mx.float32)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        return self.forward_segments([(inputs, cache, input_embeddings)])[0]

    def forward_segments(self, segments: list[tuple[mx.array, list[Any] | None, mx.array | None]]
                         ) -> list[mx.array]:
        """Several (inputs [B, L], cache, input_embeddings) blocks in one pass: their rows share
        every matrix product (each weight is read once for all of them; each row's result is
        the same as alone, as the kernels compute every row on its own), and each block attends
        over its own cache. Returns each block's output [B, L, hidden]."""
        blocks = [self.begin(inputs, cache, embeds) for inputs, cache, embeds in segments]
        self.advance([(block, len(self.layers)) for block in blocks])
        return [self.finish(block) for block in blocks]

    def begin(self, inputs: mx.array, cache: list[Any] | None,
              input_embeddings: mx.array | None = None) -> "RowsInFlight":
        """A block of token rows before the first layer: its input embeddings, and the masks and
        positions of its cache as it is now (later layers' caches still hold only what came
        before the block, whatever layers it has passed)."""
        if input_embeddings is None and self._stored_embed is not None:
            # The stored table's rows and their float32 scale in NumPy: the same products as
            # MLX's (one float32 multiply a value) without building and evaluating its graph,
            # a tenth of a millisecond of every decode step.
            batch, length = int(inputs.shape[0]), int(inputs.shape[1])
            x = self._stored_embed.rows(inputs)  # a new array: the layers add into it in place
            if self._stored_scale is not None:
                x *= self._stored_scale
        else:
            h = self._embeddings(inputs, input_embeddings)
            batch, length = int(h.shape[0]), int(h.shape[1])
            # A fresh, writable copy of the rows: the layers add into it in place.
            x = np.array(h.reshape(batch * length, self.hidden_size))
        positions = np.ascontiguousarray(
            (_offsets(cache, batch)[:, None] + np.arange(length, dtype=np.int64)).reshape(-1))
        return RowsInFlight(cache, batch, length, x, self._masks(batch, length, cache),
                            positions)

    def advance(self, blocks: list[tuple["RowsInFlight", int]]) -> None:
        """Run each block on through its layers up to (not including) its stop layer. Where
        blocks pass the same layer they share its matrix products; a block's results do not
        depend on which others ran beside it, nor on where its layers were split into calls."""
        if not blocks:
            return
        if self.steps_in_one_call and self._step_in_one_call(blocks):
            return
        k = self._kernels
        first_layer = min(block.done for block, _ in blocks)
        last_layer = max(stop for _, stop in blocks)
        members: list[RowsInFlight] = []  # the blocks whose rows `x` holds, in order
        pending: list[mx.array] = []  # cache buffers whose update is queued, not evaluated
        x = np.empty((0, self.hidden_size), np.float32)
        for index in range(first_layer, last_layer):
            active = [block for block, stop in blocks if block.done <= index < stop]
            if not active:
                continue
            if active != members:
                _scatter(x, members)
                members = active
                x = (active[0].x if len(active) == 1
                     else np.concatenate([block.x for block in active]))
            layer = self.layers[index]
            rows = x.shape[0]
            qkv, scratch, attended = self._buffers(rows, layer)
            positions = (members[0].positions if len(members) == 1
                         else np.concatenate([block.positions for block in members]))
            k.layer_pre(layer.args, x, positions, qkv,
                        scratch.reshape(-1)[:rows * self.hidden_size].reshape(rows, -1))
            first = 0
            for block in members:
                last = first + block.rows
                layer_cache = block.cache[index] if block.cache else None
                if self._attention(layer, layer_cache, block.masks[layer.sliding],
                                   qkv[first:last], attended[first:last], block.batch,
                                   block.length):
                    pending += [layer_cache.keys, layer_cache.values]
                first = last
            k.layer_post(layer.args, x, attended, scratch)
            for block in members:
                block.done = index + 1
        _scatter(x, members)
        # The decode steps' cache updates, all at once and off this thread: each layer's own
        # evaluation cost ~70 us of MLX scheduling.
        if pending:
            mx.async_eval(pending)

    def _step_in_one_call(self, blocks: list[tuple["RowsInFlight", int]]) -> bool:
        """`advance` in one C call (step.c) where every block passes the same layers, is one
        batch row over its own cache, and every cache's update is one `tail_layout` knows
        (decode rows, drafts to verify, prompt chunks over a cache that holds keys): then the
        caches' updates, queued. False (nothing done) for any other step."""
        step = self.step
        first, stop = blocks[0][0].done, blocks[0][1]
        if step is None or stop <= first or any(
                block.done != first or block_stop != stop or block.batch != 1 or not block.cache
                or (block.length == 1 and any(mask is not None for mask in block.masks.values()))
                for block, block_stop in blocks):
            return False
        plan = self._plan_caches(blocks, first, stop)
        if plan is None:
            return False
        entries, foreseen, overwritten = plan
        layer0 = self.layers[first]
        rows = sum(block.rows for block, _ in blocks)
        x = blocks[0][0].x if len(blocks) == 1 else np.concatenate([b.x for b, _ in blocks])
        positions = (blocks[0][0].positions if len(blocks) == 1
                     else np.concatenate([block.positions for block, _ in blocks]))
        size = (stop - first) * rows * layer0.width
        if self._step_qkv.size < size:
            self._step_qkv = np.empty(size, np.float32)
        qkv = self._step_qkv[:size].reshape(stop - first, rows, layer0.width)
        _, scratch, attended = self._buffers(rows, layer0)
        self._kernels.step_layers(step, first, stop, [block.rows for block, _ in blocks],
                                  entries, x, positions, qkv, scratch, attended)
        del entries, plan  # the buffers' views: the updates below may write in place
        pending = self._update_caches(blocks, first, stop, qkv, foreseen, overwritten)
        _scatter(x, [block for block, _ in blocks])
        for block, _ in blocks:
            block.done = stop
        mx.async_eval(pending)
        self.one_call_steps += 1
        return True

    def _plan_caches(self, blocks: list[tuple["RowsInFlight", int]], first: int, stop: int
                     ) -> tuple[list[StepCache], list[tuple[int, int, int]],
                                list[tuple[np.ndarray, np.ndarray] | None]] | None:
        """Per layer and block, in that order: the cache as the kernel reads it (a view of its
        buffers with the layout its new keys meet), the layout the cache's update must leave
        (checked after it), and the keys and values a block will write over in a full window's
        ring (rewind.cache.window_blocks: it goes in place), else None. None where a cache's
        update or mask is not one the kernel takes."""
        heads = self.layers[first].heads
        entries: list[StepCache] = []
        foreseen: list[tuple[int, int, int]] = []
        overwritten: list[tuple[np.ndarray, np.ndarray] | None] = []
        writer = self.block_writer
        for index in range(first, stop):
            sliding = self.layers[index].sliding
            for block, _ in blocks:
                cache = block.cache[index]
                layout = tail_layout(cache, block.length)
                if layout is None:
                    return None
                (total, position, rotation, ring), after = layout
                mask = mask_for_kernel(block.masks[sliding], heads, block.length, total)
                if mask is None:
                    return None
                # Views of the buffers as they are (evaluating the last step's queued updates),
                # held until the call returns and dropped before the updates, which may then
                # write in place.
                keys_view, values_view = host_view(cache.keys), host_view(cache.values)
                saved = None
                if block.length > 1 and writer is not None and writer.takes_in_place(
                        cache, block.length):
                    slots = writer.block_slots(cache, block.length)
                    saved = (keys_view[:, :, slots], values_view[:, :, slots])  # copies
                    size = cache.max_size
                    after = (size, cache.offset + block.length - size, (slots[-1] + 1) % size)
                entries.append(StepCache(keys_view, values_view, total, position, rotation,
                                         ring, mask[0], mask[1]))
                foreseen.append(after)
                overwritten.append(saved)
                del keys_view, values_view
        return entries, foreseen, overwritten

    def _update_caches(self, blocks: list[tuple["RowsInFlight", int]], first: int, stop: int,
                       qkv: np.ndarray, foreseen: list[tuple[int, int, int]],
                       overwritten: list[tuple[np.ndarray, np.ndarray] | None]) -> list[mx.array]:
        """Each cache takes its block's new keys and values from the step's projections (in
        place in a full window's ring, else its own update), checked against the layout
        foreseen; returns the updated arrays, to be evaluated after the step (nothing reads
        them before the next one)."""
        layer0 = self.layers[first]
        q_width, kv_width = layer0.heads * layer0.head_dim, layer0.kv_heads * layer0.head_dim
        writer = self.block_writer
        pending: list[mx.array] = []
        at = 0
        for index in range(first, stop):
            row = 0
            for block, _ in blocks:
                cache = block.cache[index]
                projected = qkv[index - first, row:row + block.rows]
                # [1, kv_heads, rows, D] copies of the new keys and values (NumPy views in).
                shape = (block.rows, -1, layer0.head_dim)
                new_keys = mx.array(projected[:, q_width:q_width + kv_width].reshape(shape)
                                    .transpose(1, 0, 2)[None])
                new_values = mx.array(projected[:, q_width + kv_width:].reshape(shape)
                                      .transpose(1, 0, 2)[None])
                if overwritten[at] is not None:
                    keys, values = writer.write_in_place(cache, new_keys, new_values,
                                                         *overwritten[at])
                else:
                    keys, values = cache.update_and_fetch(new_keys, new_values)
                if not moved_as_foreseen(cache, keys, foreseen[at]):
                    raise RuntimeError(f"layer {index}'s {type(cache).__name__} moved otherwise "
                                       f"than foreseen for {block.rows} new keys")
                pending += [keys, values]
                at += 1
                row += block.rows
        return pending

    def finish(self, block: "RowsInFlight") -> mx.array:
        """The block's output [B, L, hidden] (final norm applied), once it passed every layer."""
        if block.done != len(self.layers):
            raise ValueError(f"the block passed {block.done} of {len(self.layers)} layers")
        normed = np.empty_like(block.x)
        self._kernels.rows_rms_norm(block.x, self.norm, self.eps, normed)
        return mx.array(normed).reshape(block.batch, block.length, self.hidden_size)

    @staticmethod
    def _attention(layer: _NativeLayer, layer_cache: Any, mask: Any, qkv: np.ndarray,
                   attended: np.ndarray, batch: int, length: int) -> bool:
        """attended [rows, heads * D] = attention of the projected rows in `qkv`, after the new
        keys and values went into the cache. True where the cache's update was left to
        evaluate (a decode step: see cpu_attention.decode_attention_into)."""
        heads, kv, dim = layer.heads, layer.kv_heads, layer.head_dim
        if qkv.shape != (batch * length, layer.width) or \
                attended.shape != (batch * length, heads * dim):
            raise ValueError(f"attention rows: qkv {qkv.shape} and output {attended.shape} for "
                             f"{batch} x {length} rows of width {layer.width}")
        # [B, heads, L, D] views of each row's heads, no copy: NumPy works out the strides.
        by_head = qkv.reshape(batch, length, heads + 2 * kv, dim).transpose(0, 2, 1, 3)
        keys = mx.array(by_head[:, heads:heads + kv], KV_DTYPE)
        values = mx.array(by_head[:, heads + kv:], KV_DTYPE)
        queries = by_head[:, :heads]
        out = attended.reshape(batch, length, heads, dim).transpose(0, 2, 1, 3)
        if layer_cache is not None and decode_attention_into(queries, keys, values, layer_cache,
                                                             layer.scale, mask, out):
            return True
        if layer_cache is not None:
            keys, values = layer_cache.update_and_fetch(keys, values)
        if attention_into(queries, keys, values, layer.scale, mask, out, cache=layer_cache):
            return False
        # MLX's attention, e.g. for a quantized KV cache.
        from mlx_lm.models.base import scaled_dot_product_attention

        result = scaled_dot_product_attention(mx.array(queries), keys, values, cache=layer_cache,
                                              scale=layer.scale, mask=mask)
        out[...] = np.asarray(result.astype(mx.float32))
        return False


def choose_form(backbone: Any, form: str) -> str:
    """"auto" -> bf16 when every layer weight is bf16-exact (the answer does not change), else
    f32; any other form as given."""
    if form != "auto":
        return form
    from mlx.utils import tree_flatten

    weights = [value for block in backbone.layers for module in (block.self_attn, block.mlp)
               for _, value in tree_flatten(module.parameters()) if value.ndim == 2]
    return "bf16" if _is_bf16_exact(weights) else "f32"


_NATIVE_CLASSES: dict[type, type] = {}  # mlx-lm backbone class -> its native subclass
_MLX_CLASSES: dict[type, type] = {}  # and back, to give a backbone its class again
# backbone -> its NativeForward: the backend's table, not an attribute on mlx-lm's object.
_FORWARDS: ObjectTable[NativeForward] = ObjectTable()


def _native_class(cls: type) -> type:
    """A subclass of the backbone's class whose call is the native forward pass: the backbone
    instance takes it, so a direct call of the model (mlx-lm's generate, a test's reference)
    runs the same pass as the runner. mlx-lm's classes and functions stay as shipped."""
    if cls not in _NATIVE_CLASSES:
        def __call__(self: Any, inputs: mx.array, cache: list[Any] | None = None,
                     input_embeddings: mx.array | None = None) -> mx.array:
            forward = _FORWARDS.get(self)
            if forward is None:  # removed: MLX's own pass
                return cls.__call__(self, inputs, cache, input_embeddings)
            return forward(inputs, cache, input_embeddings)

        native = type(f"Native{cls.__name__}", (cls,), {"__call__": __call__})
        _NATIVE_CLASSES[cls] = native
        _MLX_CLASSES[native] = cls
    return _NATIVE_CLASSES[cls]


def requested_form(form: str | None = None) -> str:
    from rewind import env

    form = form or env.native_form() or DEFAULT_FORM  # REWIND_NATIVE
    if form not in (*WEIGHT_FORMS, STORED_FORM):
        raise ValueError(f"REWIND_NATIVE={form!r}: expected one of {', '.join(WEIGHT_FORMS)}")
    return form


def install_native_forward(model: Any, form: str | None = None,
                           stored: StoredWeights | None = None) -> NativeForward | None:
    """Route `model`'s backbone through the C kernels; None when the kernels or the family are
    not available (MLX's path then runs, with the same answers). Form "gguf" reads `stored`,
    the weights of the file the model came from, in place."""
    form = requested_form(form)
    if form == "off":
        return None
    if (form == "gguf") != (stored is not None):
        raise ValueError("the gguf form reads stored weights, and only it does")
    from rewind.kernels import boundary

    kernels = boundary.kernels()
    split = split_model(model)
    if kernels is None or split is None:
        return None
    remove_native_forward(model)  # installing again replaces, never nests
    backbone = split.backbone
    swapped: list[tuple[Any, str, Any]] = []
    try:
        _family(backbone)  # before looking at layers: other families have other modules
        if stored is not None:
            swapped = _swap_in_place_modules(model, backbone, stored, kernels)
        forward = NativeForward(backbone, choose_form(backbone, form), kernels, stored=stored)
    except Unsupported as exc:
        _swap_back(model, swapped)
        log.info("native forward not used: %s", exc)
        return None
    forward.swapped = swapped
    _FORWARDS.set(backbone, forward)
    backbone.__class__ = _native_class(type(backbone))
    return forward


def _swap_in_place_modules(model: Any, backbone: Any, stored: StoredWeights,
                           kernels: Kernels) -> list[tuple[Any, str, Any]]:
    """Give the model in-place modules for its embedding (and tied head) and, where the file has
    one, its output head; returns (owner, name, original) to swap back."""
    table = stored.matrices.get("model.embed_tokens")
    if table is None:
        raise Unsupported("stored weights have no embedding table")
    try:
        swapped = [(backbone, "embed_tokens", backbone.embed_tokens)]
        backbone.embed_tokens = InPlaceEmbedding(table, kernels)
        head = stored.matrices.get("lm_head")
        owner = getattr(model, "language_model", model)
        if head is not None and "lm_head" in owner:
            swapped.append((owner, "lm_head", owner.lm_head))
            owner.lm_head = InPlaceLinear(head, kernels)
    except ValueError as exc:  # a table the kernels cannot read
        _swap_back(model, swapped)
        raise Unsupported(f"stored embedding or head: {exc}") from exc
    forget_split(model)  # the head is looked up again: the in-place one
    return swapped


def _swap_back(model: Any, swapped: list[tuple[Any, str, Any]]) -> None:
    for owner, name, original in reversed(swapped):
        setattr(owner, name, original)
    if swapped:
        forget_split(model)


def native_forward(model: Any) -> NativeForward | None:
    split = split_model(model)
    return None if split is None else _FORWARDS.get(split.backbone)


def remove_native_forward(model: Any) -> bool:
    """Give the backbone its MLX call back; True when there was a native one."""
    split = split_model(model)
    backbone = None if split is None else split.backbone
    forward = None if backbone is None else _FORWARDS.pop(backbone)
    if forward is None:
        return False
    backbone.__class__ = _MLX_CLASSES[type(backbone)]
    _swap_back(model, forward.swapped)
    return True
