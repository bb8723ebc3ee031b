"""Per-layer additive inputs of a model call: hidden states added to given layers' outputs.

Qwen3-VL's vision tower makes, besides the image tokens' input embeddings, "deepstack" features
that its language model adds to the hidden states after each of its first layers, at the image
positions (mlx-vlm's `Qwen3VLModel`: `h = layer(h, ...)`, then `h[image positions] +=
deepstack[layer]`). mlx-lm's backbones call their layers with (x, mask, cache) only, so such
inputs cannot travel as arguments. `install_layer_residuals(model, layers)` swaps the class of
each given layer for a subclass whose call (Rewind's code, around mlx-lm's own call) adds the
residual the engine gives for that layer in the current call (the parameter tree and every name
stay as they are); the scheduler sets them around each prefill chunk with `given_residuals`.
Which holder and layer index a layer reads, and each model's holder, live in tables of ours
keyed by the layer and the model (rewind.kernels.object_table), never as attributes on mlx-lm's
objects. A residual is [B, L, hidden] for the call's
positions (zeros where nothing is added, so those positions are exactly the layer's output).

The CPU kernels (rewind.kernels.native_forward) never call the layers, so a model must run
MLX's layers before it takes residuals; `install_layer_residuals` refuses otherwise.

Engine thread only (the one thread that calls the model); the residuals are read while the call
builds its graph, so clearing them after the call is safe with MLX's lazy evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rewind.kernels.object_table import ObjectTable


class LayerResiduals:
    """Layer index -> residual [B, L, hidden] of the model call in progress, or None."""

    def __init__(self) -> None:
        self.current: Mapping[int, Any] | None = None
        self.layers: frozenset[int] = frozenset()  # the indices that were wrapped


_HOLDERS: ObjectTable[LayerResiduals] = ObjectTable()  # model -> its holder
_SLOTS: ObjectTable[tuple[LayerResiduals, int]] = ObjectTable()  # layer -> (holder, index)
_classes: dict[type, type] = {}


def _residual_class(cls: type) -> type:
    """A subclass of a layer class whose call adds the layer's current residual, if any."""
    if cls not in _classes:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            slot = _SLOTS.get(self)  # set with the class, so never None here
            assert slot is not None
            holder, index = slot
            residual = None if holder.current is None else holder.current.get(index)
            return out if residual is None else out + residual.astype(out.dtype)

        _classes[cls] = type(f"Residual{cls.__name__}", (cls,), {"__call__": __call__})
    return _classes[cls]


def residuals_holder(model: Any) -> LayerResiduals | None:
    return _HOLDERS.get(model)


def takes_residuals(model: Any) -> bool:
    return residuals_holder(model) is not None


def install_layer_residuals(model: Any, layers: Sequence[Any]) -> LayerResiduals:
    """Let `layers` (the backbone's layers 0 .. len(layers) - 1, in order) take residuals;
    idempotent. The model must run MLX's layers (not the CPU kernels)."""
    from rewind.kernels.native_forward import native_forward

    if native_forward(model) is not None:
        raise ValueError("the CPU kernels do not call the layers: switch the model to MLX's "
                         "layers before it takes layer residuals")
    holder = residuals_holder(model)
    if holder is None:
        holder = LayerResiduals()
        _HOLDERS.set(model, holder)
    for index, layer in enumerate(layers):
        if _SLOTS.get(layer) is None:
            layer.__class__ = _residual_class(type(layer))
            _SLOTS.set(layer, (holder, index))
    holder.layers = holder.layers | frozenset(range(len(layers)))
    return holder


@contextmanager
def given_residuals(model: Any, residuals: Mapping[int, Any] | None) -> Iterator[None]:
    """Run the model calls inside with `residuals` (layer index -> [B, L, hidden]); a no-op for
    None. Raises ValueError for a layer that does not take residuals (the model would silently
    compute without them)."""
    if residuals is None:
        yield
        return
    holder = residuals_holder(model)
    missing = set(residuals) - (holder.layers if holder is not None else frozenset())
    if missing:
        raise ValueError(f"layer(s) {sorted(missing)} of this model take no residuals")
    holder.current = residuals
    try:
        yield
    finally:
        holder.current = None
