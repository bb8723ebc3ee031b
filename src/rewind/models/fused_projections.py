"""Sibling projections that read the same input, run as one matrix product (MLX's layers on a
GPU).

Why: on a GPU a small model's decode step is bound by the host, and MLX's host cost grows with
the kernels a step launches. A matrix product costs most of them: on CUDA each is a cuBLAS call
captured into a child graph of the step's CUDA graph (111 of a Llama-3.2-1B step's ~390 kernels
at 32 rows on an H100, `cudaGraphAddChildGraphNode` and `cudaGraphDestroy` ~0.5 ms of the step's
3.3 ms of CUDA calls; benchmarks/results/gpu/decode-profile-compiled-h100-9b8225f.md). An
attention layer's q, k and v projections and an MLP's gate and up projections read one input:
their weights stacked along the output give one product for three (two), seven products a Llama
layer become four. The parts are slices of that product (views: MLX reshapes a strided slice
without copying it), so the family's own code runs unchanged.

What it takes: a module whose q_proj/k_proj/v_proj (or gate_proj/up_proj) are all nn.Linear, or
all nn.QuantizedLinear of one group size, width and mode, of one input width, all with a bias or
none. Anything else keeps its layers. The parts hand out slices of the last input's product;
called with another input (a layer that projects two inputs), a part computes the whole product
for it, which gives the right answer at more cost.

Not on the CPU: Rewind's C kernels read each projection's own weights there. Not with a sharded
model (rewind.parallel.shard splits q_proj and its siblings by name): rewind.parallel.serving
loads without it. Answers: each output column is the same dot product, but the product's kernel
(its tiling) may round differently from the separate ones', so the fused layers' form is part of
the prompt cache's fingerprint (rewind.models.loader).

REWIND_FUSED_PROJECTIONS: auto (the default) is on with MLX's CUDA backend, off elsewhere; on
(any GPU backend; Metal is not measured); off. Measured on an H100, each form an engine of its
own in one process (`rewind bench decode-scaling --parts fused / unfused`): Llama-3.2-1B's median
step 7-22% shorter fused at 8 and 32 streams in two runs (at one stream 6% shorter in one, 24%
longer in the other, whose tokens/s were still 287 fused against 242). Qwen 3.5 0.8B's favoured
whichever engine ran second, in both orders (30f33af: unfused second, 5-8% shorter; 3896784:
fused second, 5-13% shorter): the order in the process, not the fusion, so hybrids fuse too.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from rewind import env
from rewind.kernels.cuda_device import on_cuda

# The sibling sets, in the order their products are stacked.
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProduct:
    """One fused layer and its last input's product, until every part has taken its slice (a
    plain object: the fused layer is a child of the module that owned the parts, once). One
    thread runs a model at a time (the engine's), as with mlx-lm's caches."""

    def __init__(self, layer: nn.Module, widths: list[int]) -> None:
        self.layer = layer
        self.bounds: list[tuple[int, int]] = []
        at = 0
        for width in widths:
            self.bounds.append((at, at + width))
            at += width
        self._everyone = (1 << len(widths)) - 1
        self._input: mx.array | None = None
        self._output: mx.array | None = None
        self._taken = 0

    def part(self, index: int, x: mx.array) -> mx.array:
        if self._input is not x:
            self._input, self._output, self._taken = x, self.layer(x), 0
        start, stop = self.bounds[index]
        out = self._output[..., start:stop]
        self._taken |= 1 << index
        if self._taken == self._everyone:
            # every part has its slice: keep no activation (or trace) past the layer's call
            self._input = self._output = None
        return out


class FusedPart(nn.Module):
    """Stands where one projection was: its slice of the shared product. No parameters of its
    own (the module tree holds the fused layer once, under `fused_name`)."""

    def __init__(self, shared: SharedProduct, index: int, input_dims: int) -> None:
        super().__init__()
        self._shared = shared
        self._index = index
        self.input_dims = input_dims
        start, stop = shared.bounds[index]
        self.output_dims = stop - start

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared.part(self._index, x)


def wanted() -> bool:
    """REWIND_FUSED_PROJECTIONS: auto means on with MLX's CUDA backend."""
    setting = env.fused_projections()
    if setting == "auto":
        return on_cuda()
    return setting == "on"


def fused_name(names: tuple[str, ...]) -> str:
    """The fused layer's attribute: "q_proj_k_proj_v_proj"."""
    return "_".join(names)


def _stackable(layers: list[Any]) -> bool:
    first = layers[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(x) is not kind for x in layers):
        return False
    has_bias = ["bias" in x for x in layers]
    if any(has_bias) and not all(has_bias):
        return False
    if kind is nn.QuantizedLinear:
        settings = {(x.group_size, x.bits, x.mode) for x in layers}
        keys = {tuple(sorted(k for k in x if isinstance(x[k], mx.array))) for x in layers}
        shapes = {tuple(x[k].shape[1:] for k in sorted(x) if isinstance(x[k], mx.array)
                        and k != "bias") for x in layers}
        return len(settings) == 1 and len(keys) == 1 and len(shapes) == 1
    return len({x.weight.shape[1] for x in layers}) == 1 and all(x.weight.ndim == 2 for x in layers)


def _stack(layers: list[Any]) -> nn.Module:
    """One layer whose outputs are the layers' outputs side by side (the layers' arrays
    concatenated along the output axis; the new layer's own initial arrays are lazy and never
    computed)."""
    first = layers[0]
    if type(first) is nn.QuantizedLinear:
        fused = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(fused)
        fused.group_size, fused.bits, fused.mode = first.group_size, first.bits, first.mode
        for key in first:
            if isinstance(first[key], mx.array):
                fused[key] = mx.concatenate([x[key] for x in layers], axis=0)
        fused.freeze()
        return fused
    fused = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(fused)
    fused.weight = mx.concatenate([x.weight for x in layers], axis=0)
    if "bias" in first:
        fused.bias = mx.concatenate([x.bias for x in layers], axis=0)
    return fused


def use_in_model(model: nn.Module) -> int:
    """Fuse every sibling set of `model` that can be (see the module docstring), in place, one
    module at a time (the stacked weights are computed before the separate ones are dropped,
    so memory grows by one module's projections at most). Returns the sets fused."""
    fused_sets = 0
    for _, module in model.named_modules():
        # a layer that reuses another's keys and values (Gemma 3n's KV-shared layers) calls
        # only q_proj: fused, it would compute k and v for nothing and hold the product
        shares_kv = bool(getattr(module, "is_kv_shared_layer", False))
        for names in SIBLINGS:
            layers = [module.get(name) if isinstance(module, dict) else None for name in names]
            if (any(layer is None for layer in layers) or not _stackable(layers)
                    or (shares_kv and "q_proj" in names)):
                continue
            input_dims = _input_dims(layers[0])
            shared = SharedProduct(_stack(layers), [x.weight.shape[0] for x in layers])
            mx.eval(shared.layer.parameters())
            setattr(module, fused_name(names), shared.layer)
            for index, name in enumerate(names):
                setattr(module, name, FusedPart(shared, index, input_dims))
            fused_sets += 1
    return fused_sets


def _input_dims(layer: Any) -> int:
    if type(layer) is nn.QuantizedLinear:
        return layer.weight.shape[1] * 32 // layer.bits
    return layer.weight.shape[1]


def fused_in(model: nn.Module) -> bool:
    """Whether any of `model`'s projections run fused."""
    return any(isinstance(module, FusedPart) for _, module in model.named_modules())
