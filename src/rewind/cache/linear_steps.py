"""Giving tokens back out of a linear-attention layer's state (Qwen 3.5's gated delta rule).

A linear-attention layer (mlx-lm's GatedDeltaNet, whose cache is an ArraysCache of [conv state,
recurrent state]) folds every token into its state, which cannot be unfolded. A speculative
step feeds a row its input and k drafted tokens in one call and may keep only the first j: the
state after j tokens is needed, and the call computed only the state after all of them.

While a drafting row's call runs under `recording(cache)`, each such layer keeps what it needs
to redo its own small part: the state from before the call (the object itself, no copy), the
convolution's input rows, and the recurrence's inputs. Taking tokens back (`give_back`) puts the
last `kernel - 1` convolution inputs up to the kept position back as the conv state and runs
the recurrence over the kept positions again from the old state, in the same kernel, which
steps through positions one after another: the state is the bits a call of the kept tokens
alone would have left, at the cost of the recurrence alone (no weight is read again).

The layer's inputs come to two hooks, in the order every GatedDeltaNet call makes them: its
depthwise convolution's input (`install` gives each such layer's conv1d a recording class),
then Rewind's gated_delta_update (rewind.kernels.gated_delta), which hands its arguments to the
observer the runner registers (`note_recurrence`); the recurrent state it is handed is the
cache's own object, which names the layer. `install` checks with one recorded call that every
layer's record comes out whole; a model where it does not (another mlx-lm's layer) does not
draft, rather than fail a request at its first rollback.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

_ATTRIBUTE = "_rewind_step"  # an ArraysCache's record of its last recorded call


@dataclass
class StepRecord:
    """What one linear-attention layer needs to redo its last call for fewer tokens."""

    conv_before: mx.array
    state_before: mx.array
    conv_input: mx.array | None = None  # [B, kernel - 1 + T, C]: the old conv state, then T rows
    recurrence: dict[str, Any] | None = None  # gated_delta_update's arguments of the call
    rerun: Callable[..., Any] | None = None  # the gated_delta_update that ran it

    @property
    def complete(self) -> bool:
        return (self.conv_input is not None and self.recurrence is not None
                and self.rerun is not None)


@dataclass
class _Recording:
    by_state: dict[int, StepRecord] = field(default_factory=dict)
    conv_input: mx.array | None = None  # the last convolution's input, for the next recurrence


_local = threading.local()


def _current() -> _Recording | None:
    return getattr(_local, "recording", None)


def leaf_caches(layers: list[Any]) -> Iterator[Any]:
    """Every layer cache of a sequence's cache, those inside a CacheList one by one."""
    for layer in layers:
        if type(layer) is CacheList:
            yield from leaf_caches(list(layer.caches))
        else:
            yield layer


def _linear_layers(layers: list[Any]) -> Iterator[ArraysCache]:
    return (layer for layer in leaf_caches(layers) if type(layer) is ArraysCache)


@contextmanager
def recording(layers: list[Any]) -> Iterator[None]:
    """Record the linear-attention layers of `layers` (one sequence's cache) through one model
    call. Each ArraysCache holding a state keeps a StepRecord until `give_back`."""
    active = _Recording()
    for layer in _linear_layers(layers):
        setattr(layer, _ATTRIBUTE, None)
        if layer[1] is not None and layer[0] is not None:
            record = StepRecord(layer[0], layer[1])
            active.by_state[id(layer[1])] = record
            setattr(layer, _ATTRIBUTE, record)
    outer = _current()
    _local.recording = active
    try:
        yield
    finally:
        _local.recording = outer


def note_conv_input(x: mx.array) -> None:
    """The depthwise convolution's hook: its input, for the recurrence that follows it."""
    active = _current()
    if active is not None:
        active.conv_input = x


def note_recurrence(state: Any, arguments: dict[str, Any], rerun: Callable[..., Any]) -> None:
    """gated_delta_update's observer (rewind.kernels.gated_delta.observe): its arguments and
    itself, filed under the cache's state it was given."""
    active = _current()
    if active is None or state is None:
        return
    record = active.by_state.get(id(state))
    if record is not None and record.state_before is state:
        record.conv_input, record.recurrence, record.rerun = (active.conv_input, arguments,
                                                              rerun)
    active.conv_input = None


def can_give_back(layer: Any) -> bool:
    """Whether a linear-attention layer's last call was recorded in full."""
    record = getattr(layer, _ATTRIBUTE, None)
    return (type(layer) is ArraysCache and record is not None and record.complete
            and layer.lengths is None and layer.left_padding is None)


def give_back(layer: ArraysCache, tokens: int) -> None:
    """Take the last `tokens` tokens of its recorded call out of `layer`; forget the record."""
    record: StepRecord | None = getattr(layer, _ATTRIBUTE, None)
    setattr(layer, _ATTRIBUTE, None)
    if tokens == 0:
        return
    if record is None or not record.complete:
        raise ValueError("a linear-attention layer gives tokens back only after a recorded call")
    assert record.conv_input is not None and record.recurrence is not None
    assert record.rerun is not None
    width = record.conv_before.shape[1]  # kernel - 1 rows of conv state
    steps = record.conv_input.shape[1] - width
    kept = steps - tokens
    if kept < 0:
        raise ValueError(f"a call of {steps} tokens cannot give back {tokens}")
    if kept == 0:
        layer[0], layer[1] = record.conv_before, record.state_before
        return
    arguments = dict(record.recurrence)
    for name in ("q", "k", "v", "a", "b"):
        arguments[name] = arguments[name][:, :kept]
    if arguments.get("mask") is not None:
        arguments["mask"] = arguments["mask"][:, :kept]
    arguments["state"] = record.state_before
    _, state = record.rerun(**arguments)
    layer[0] = mx.contiguous(record.conv_input[:, kept:kept + width, :])
    layer[1] = state


def forget(layers: list[Any]) -> None:
    """Drop the records of `layers` (a call whose tokens were all kept)."""
    for layer in _linear_layers(layers):
        setattr(layer, _ATTRIBUTE, None)


# ---- the hooks in the model --------------------------------------------------------------------


_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    if cls not in _RECORDING_CLASSES:
        def __call__(self: Any, x: mx.array) -> mx.array:
            note_conv_input(x)
            return cls.__call__(self, x)

        _RECORDING_CLASSES[cls] = type(f"Recording{cls.__name__}", (cls,),
                                       {"__call__": __call__})
    return _RECORDING_CLASSES[cls]


def _is_gated_delta_layer(module: Any) -> bool:
    return all(hasattr(module, name) for name in ("conv1d", "A_log", "dt_bias", "in_proj_qkv"))


def install(model: Any) -> bool:
    """Give every gated-delta layer's convolution of `model` its recording class (the caller
    also hands `note_recurrence` to rewind.kernels.gated_delta.observe). True where every
    ArraysCache of the model's cache belongs to such a layer, so that each can give tokens
    back (other state-space layers cannot)."""
    layers = [m for m in model.modules() if _is_gated_delta_layer(m)]
    for module in layers:
        conv = module.conv1d
        if type(conv) not in _RECORDING_CLASSES.values():
            conv.__class__ = _recording_class(type(conv))
    make_cache = getattr(model, "make_cache", None)
    if not layers or make_cache is None:
        return False
    if (sum(1 for _ in _linear_layers(make_cache())) != len(layers)
            or len({type(module) for module in layers}) != 1):
        return False
    return _records_in_full(layers[0])


def _records_in_full(module: Any) -> bool:
    """Whether a recorded call of one of the model's gated-delta layers (all of one class)
    leaves it a complete record: a layer whose call no longer reaches the hooks as expected
    (another mlx-lm) would make a drafting row fail at its rollback, so such a model does not
    draft. One layer's two small calls, not the model's: on a random model of Qwen 3.5 0.8B's
    shape, on 2 cores, 21-38 ms where the whole model's took 0.76 s at start-up."""
    cache = ArraysCache(2)
    try:
        dtype = module.dt_bias.dtype
        width = module.hidden_size
        mx.eval(module(mx.zeros((1, 3, width), dtype), cache=cache))
        with recording([cache]):
            mx.eval(module(mx.full((1, 2, width), 0.01, dtype), cache=cache))
    except (AttributeError, TypeError, ValueError, RuntimeError):  # another shape or signature
        return False
    complete = can_give_back(cache)
    forget([cache])
    return complete
