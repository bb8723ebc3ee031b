"""The decode batch's forward call built once per shape and replayed (mx.compile), for MLX's
layers (GPUs; the CPU only with REWIND_NATIVE=off, where the C kernels do not run the model).

Why: on a GPU a decode step of a small model is bound by the host. mlx-lm's layers rebuild the
step's graph in Python every step (~1.4-2.3 ms for a 16-layer Llama on an H100's host), and
mlx-lm's caches make every step's graph new: attention reads a slice that grows by one key, and
the write position is a Python integer. Here the step sees each layer's GrowingBatchKVCache as a
`DecodeView`: the whole buffer (its capacity is a rung of the ladder, the same for many steps),
the write position and each row's first key as device arrays. Every step of one batch size and
capacity then has the same shapes, so mx.compile traces the step once, replays the trace after
that, and fuses its elementwise chains (benchmarks/probes/compiled_step.py: 1.1-1.4x mlx-lm's
step at 1, 8 and 32 rows on an H100, same greedy tokens, the same process).

Attention over the view: on CUDA Rewind's decode kernel reads keys [starts[b], length) with the
length from the device (rewind.kernels.cuda_attention); elsewhere MLX's attention takes the
view's mask over the whole buffer. The buffers are written in place: the step owns them while it
runs (the caches hold none), so MLX donates them to its writes instead of copying them.

What it takes: a decode step (one token a row, the last position's logits, no per-call model
state), caches that are all GrowingBatchKVCache (full attention; no sliding window, linear
attention or quantized cache), a buffer with room for the step's key, a model that runs whole
in this process. Anything else, and any model whose trace fails, runs the plain call.
REWIND_COMPILED_DECODE=on turns it on (off by default until measured in the engine on a GPU).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from rewind import env
from rewind.cache.kv import GrowingBatchKVCache
from rewind.engine.segment import RowCaches, Segment

log = logging.getLogger(__name__)


class DecodeView:
    """One layer's batch cache as a fixed-shape decode step sees it: `keys`/`values` are the
    whole buffers [B, H, capacity, D], `length` [1] the slot the step's key goes to, `starts`
    [B] each row's first key (its left padding). All device arrays."""

    # rewind.kernels.cuda_attention takes its keys from the view by this mark
    fixed_capacity = True

    def __init__(self, keys: mx.array, values: mx.array, starts: mx.array, length: mx.array):
        self.keys, self.values, self.starts, self.length = keys, values, starts, length

    @property
    def offset(self) -> mx.array:
        """Each row's position of the step's token (RoPE), as BatchKVCache's offset."""
        return self.length - self.starts

    def filled(self) -> mx.array:
        """Slots in use once the step's key is written."""
        return self.length + 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError(f"a decode view takes one key a row, got {keys.shape[2]}")
        self.keys = mx.slice_update(self.keys, keys, self.length, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.length, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None,
                  **_: Any) -> mx.array:
        """Row b attends to slots [starts[b], length]: the same keys as the batch cache's mask
        over its live slice, over the whole buffer."""
        if n != 1 or window_size is not None:
            raise ValueError("a decode view has one query a row and no window")
        slots = mx.arange(self.keys.shape[2])
        allowed = (slots[None] >= self.starts[:, None]) & (slots[None] < self.filled())
        return allowed[:, None, None, :]


class CompiledDecode:
    """The runner's compiled decode call for one model: `takes(segment)` says whether a segment
    can run through it, `__call__(segment)` runs it and advances the segment's caches."""

    def __init__(self, forward: Any) -> None:
        # forward(tokens, cache=...) -> hidden states or logits [B, 1, ...]: the model's
        # backbone where the runner splits off the head, else the whole model
        self._forward = forward
        self._compiled = mx.compile(self._step)
        self.failed: str | None = None  # why the trace failed: the plain call from then on
        self.steps = 0  # steps run through it (tests, metrics)

    def _step(self, tokens: mx.array, starts: mx.array, length: mx.array,
              *buffers: mx.array) -> list[mx.array]:
        views = [DecodeView(buffers[i], buffers[i + 1], starts, length)
                 for i in range(0, len(buffers), 2)]
        out = self._forward(tokens, cache=views)
        return [out, *(b for view in views for b in (view.keys, view.values))]

    def takes(self, segment: Segment) -> bool:
        if self.failed is not None or not env.compiled_decode():
            return False
        cache = segment.cache
        if (segment.tokens.ndim != 2 or segment.tokens.shape[1] != 1
                or segment.logit_positions != 1 or segment.embeds is not None
                or not segment.plain or segment.stop is not None or segment.carry is not None
                or isinstance(cache, RowCaches) or not cache):
            return False
        held = getattr(cache[0], "_idx", None)
        return all(type(layer) is GrowingBatchKVCache and layer.keys is not None
                   and layer.values is not None and layer._idx == held
                   and held < layer.keys.shape[2] and layer.keys.shape[0] == segment.tokens.shape[0]
                   and getattr(layer, "lengths", None) is None
                   for layer in cache)

    def __call__(self, segment: Segment) -> mx.array | None:
        """The segment's output [B, 1, ...] with its caches one key longer; None when the trace
        failed (nothing changed; the caller runs the plain call)."""
        cache = segment.cache
        starts = cache[0].left_padding.astype(mx.int32)
        length = mx.array([cache[0]._idx], mx.int32)
        buffers = [b for layer in cache for b in (layer.keys, layer.values)]
        for layer in cache:  # the step owns the buffers: MLX writes them in place
            layer.keys = layer.values = None
        try:
            out = self._compiled(segment.tokens, starts, length, *buffers)
        except Exception as exc:  # noqa: BLE001 - a model the view does not fit: plain calls
            for index, layer in enumerate(cache):
                layer.keys, layer.values = buffers[2 * index], buffers[2 * index + 1]
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("compiled decode off for this model: %s", self.failed)
            return None
        buffers.clear()
        for index, layer in enumerate(cache):
            layer.keys, layer.values = out[1 + 2 * index], out[2 + 2 * index]
            layer._idx += 1
            layer.offset = layer.offset + 1
        self.steps += 1
        return out[0]
