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

Linear-attention layers (Qwen 3.5) keep mlx-lm's ArraysCache, whose conv window and recurrent
state have fixed shapes already: the step takes and returns them. Rewind's gated-delta kernel
runs inside the trace on CUDA; the CPU's computes on the host, so a trace there takes mlx-lm's
ops for the recurrence (rewind.kernels.gated_delta.tracing) and every other call keeps the
kernel.

What it takes: a decode step (one token a row, the last position's logits, no per-call model
state), caches that are GrowingBatchKVCache (full attention, one length) or unpadded
ArraysCache (no sliding window, quantized cache or cache list), a buffer with room for the
step's key, a model that runs whole in this process. On CUDA also one row on caches of its own
(GrowingKVCache: a row decoding alone while it may draft, rewind.engine.runner), seen as a
batch of one with no padding: the same trace as a merged batch of one. Anything else, and any model whose trace
fails, runs the plain call; so does a model with a full-attention layer that scores keys
itself instead of through scaled_dot_product_attention (it would read the buffer's spare slots).

REWIND_COMPILED_DECODE: auto (the default) is on with MLX's CUDA backend, off elsewhere; on;
off. On an H100, Llama-3.2-1B shape, both in one process: 424 / 1,809 / 6,536 tokens/s at
1 / 8 / 32 streams against the plain call's 306 / 1,368 / 3,346 (docs/HARDWARE.md). On the
CPU it runs MLX's attention and recurrence where the plain call runs the C kernels, and one
stream of a Qwen 3.5 0.8B shape took as long either way within the machine's spread
(benchmarks/results/compiled-decode-cpu-qwen35-xeon.md); Metal is not measured.

Costs to know: a new row count or capacity is traced once (a step's Python build, inside a
serving step; rows are not bucketed), MLX keeps every trace while the runner lives, and
settings read inside the step (REWIND_CUDA_ATTENTION, REWIND_GATED_DELTA) take effect for
shapes traced after they change. On CUDA a view's attention is always Rewind's kernel (a row's
keys cut into up to 16 spans, so a lone long row still fills the GPU), where the plain call gives an
unpadded batch to MLX's fused attention, which is faster at long contexts with many rows
(docs/HARDWARE.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from rewind import env
from rewind.cache.kv import GrowingBatchKVCache, GrowingKVCache
from rewind.engine.segment import RowCaches, Segment
from rewind.kernels.cuda_device import on_cuda

log = logging.getLogger(__name__)


class StepPositions:
    """What every layer's view of one step derives from the step's `starts` and `length`, built
    once for all of them: the slots a scatter writes, the RoPE offsets, the attention kernel's
    bounds. Each layer deriving its own costs kernels a layer in every step (a scatter copies
    broadcast indices to contiguous ones inside its kernel, out of the trace's sight, and
    mx.compile merges no array constants): ~300 kernels a one-stream Llama-3.2-1B step on an
    H100 (decode-profile-h100-159a5d2)."""

    def __init__(self, starts: mx.array, length: mx.array) -> None:
        self.starts, self.length = starts, length
        self.offset = length - starts
        self.filled = length + 1
        self._slots: dict[tuple[int, ...], mx.array] = {}
        # rewind.kernels.cuda_attention's bounds arrays, by (capacity, spans, positions)
        self.bounds: dict[tuple[int, int, int], mx.array] = {}

    def slots(self, shape: tuple[int, ...]) -> mx.array:
        got = self._slots.get(shape)
        if got is None:
            got = self._slots[shape] = mx.contiguous(
                mx.broadcast_to(self.length.reshape(1, 1, 1, 1), shape))
        return got


class DecodeView:
    """One layer's batch cache as a fixed-shape decode step sees it: `keys`/`values` are the
    whole buffers [B, H, capacity, D], `length` [1] the slot the step's key goes to, `starts`
    [B] each row's first key (its left padding). All device arrays; `shared` holds what the
    layers of one step derive from them alike."""

    # rewind.kernels.cuda_attention takes its keys from the view by this mark
    fixed_capacity = True

    def __init__(self, keys: mx.array, values: mx.array, starts: mx.array, length: mx.array,
                 shared: StepPositions | None = None):
        self.keys, self.values, self.starts, self.length = keys, values, starts, length
        self.shared = shared if shared is not None else StepPositions(starts, length)

    @property
    def offset(self) -> mx.array:
        """Each row's position of the step's token (RoPE), as BatchKVCache's offset."""
        return self.shared.offset

    def filled(self) -> mx.array:
        """Slots in use once the step's key is written."""
        return self.shared.filled

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] != 1:
            raise ValueError(f"a decode view takes one key a row, got {keys.shape[2]}")
        # A scatter along the slot axis, not mx.slice_update at a device position: MLX's CUDA
        # backend launches that dynamic copy over the whole buffer (copy_gg_dynamic_nd: 3.65 ms
        # of a 32-row step's 8 ms of GPU time, Llama-3.2-1B shape on an H100) where the
        # scatter's threads cover only the new keys.
        slots = self.shared.slots(tuple(keys.shape))
        self.keys = mx.put_along_axis(self.keys, slots, keys, axis=2)
        self.values = mx.put_along_axis(self.values, self.shared.slots(tuple(values.shape)),
                                        values, axis=2)
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
        # Decided at the first step asked for: how many of the model's modules attend through
        # mlx-lm's scaled_dot_product_attention, and whether the model runs whole here.
        self._attention_modules: int | None = None
        self._alone: bool | None = None
        # one compiled function per layout (which layers are KV views, how many arrays the
        # others hold): a model has one; MLX keeps a trace per input shape under each
        self._compiled: dict[Layout, Any] = {}
        self.failed: str | None = None  # why the trace failed: the plain call from then on
        self.steps = 0  # steps run through it (tests, metrics)
        # Shapes traced (a new row count or capacity) by steps that then ran: each is a step's
        # Python build inside a serving step, plus MLX's compile of it; `rewind serve
        # --log-level debug` marks them. MLX retraces inside one compiled function, so the
        # traced function itself counts its runs (`_runs`, a list: the partial holds it, not
        # this object).
        self.traces = 0
        self._runs = [0]
        # the segment `takes` last saw and its layout: the runner calls `takes` then the step
        # at once, and the layout walks every layer (~0.05 ms of a one-stream step's ~2)
        self._taken: tuple[Segment, Layout] | None = None

    @staticmethod
    def _step(forward: Any, layout: Layout, runs: list[int], tokens: mx.array,
              starts: mx.array, length: mx.array, *arrays: mx.array) -> list[mx.array]:
        runs[0] += 1  # Python runs only while MLX traces: once per new shape
        caches: list[Any] = []
        shared = StepPositions(starts, length)
        at = 0
        for count in layout:
            if count == _KV:
                caches.append(DecodeView(arrays[at], arrays[at + 1], starts, length, shared))
                at += 2
            else:  # linear attention's state: mlx-lm's own class, fixed-shape already
                layer = ArraysCache(count)
                layer.cache = list(arrays[at:at + count])
                caches.append(layer)
                at += count
        out = forward(tokens, cache=caches)
        return [out, *(a for layer in caches for a in _arrays_of(layer))]

    def _layout(self, segment: Segment) -> Layout | None:
        """Each layer's kind where every layer can be seen at a fixed shape, else None."""
        cache = segment.cache
        if (segment.tokens.ndim != 2 or segment.tokens.shape[1] != 1
                or segment.logit_positions != 1 or segment.embeds is not None
                or not segment.plain or segment.stop is not None or segment.carry is not None
                or isinstance(cache, RowCaches) or not cache):
            return None
        rows = segment.tokens.shape[0]
        held = {_held(layer) for layer in cache if _full_attention(layer, rows)}
        if len(held) != 1:  # no full-attention layer, or layers of different lengths
            return None
        layout: list[int] = []
        for layer in cache:
            if _full_attention(layer, rows):
                # a slot left in the buffer: the step's scatter does not clamp its position
                if (layer.keys is None or layer.values is None
                        or _held(layer) >= layer.keys.shape[2] or layer.keys.shape[0] != rows
                        or getattr(layer, "lengths", None) is not None):
                    return None
                layout.append(_KV)
            elif type(layer) is ArraysCache:
                if (layer.lengths is not None or layer.left_padding is not None
                        or any(a is None or a.shape[0] != rows for a in layer.cache)):
                    return None
                layout.append(len(layer.cache))
            else:
                return None
        return tuple(layout)

    def takes(self, segment: Segment) -> bool:
        if self.failed is not None or not _wanted():
            return False
        if self._alone is None:
            # a sharded model's collectives stay out of traces (the engine does not import
            # rewind.parallel, which sits above it: MLX's group asked directly)
            self._alone = (not mx.distributed.is_available()
                           or mx.distributed.init().size() == 1)
            self._attention_modules = _attention_modules(self._forward)
        layout = self._layout(segment) if self._alone else None
        self._taken = (segment, layout) if layout is not None else None
        # Every full-attention layer's attention must come through the function the views are
        # made for (mlx-lm's scaled_dot_product_attention: the whole buffer under the view's
        # mask, or Rewind's kernel). A family that scores keys itself (OLMo adds the mask to
        # its scores; phi3small counts keys from the buffer) would read the view's spare slots.
        return layout is not None and layout.count(_KV) == self._attention_modules

    def __call__(self, segment: Segment) -> mx.array | None:
        """The segment's output [B, 1, ...] with its caches one step further; None when the
        trace failed (nothing changed; the caller runs the plain call)."""
        taken, self._taken = self._taken, None
        layout = taken[1] if taken is not None and taken[0] is segment else self._layout(segment)
        if layout is None:
            raise ValueError("this segment is not a fixed-shape decode step (see takes)")
        cache = segment.cache
        rows = segment.tokens.shape[0]
        full = next(layer for layer in cache if _full_attention(layer, rows))
        starts = (full.left_padding.astype(mx.int32) if type(full) is GrowingBatchKVCache
                  else mx.zeros((1,), mx.int32))
        length = mx.array([_held(full)], mx.int32)
        arrays = [a for layer in cache for a in _arrays_of(layer)]
        for layer in cache:  # the step owns the buffers: MLX writes them in place
            _set_arrays(layer, [None] * len(_arrays_of(layer)))
        compiled = self._compiled.get(layout)
        if compiled is None:
            # the traced function holds the model's forward, not this object (no reference
            # cycle through MLX's compiled function to rely on the collector for)
            compiled = self._compiled[layout] = mx.compile(
                functools.partial(CompiledDecode._step, self._forward, layout, self._runs))
        runs = self._runs[0]
        try:
            out = compiled(segment.tokens, starts, length, *arrays)
        except Exception as exc:  # noqa: BLE001 - a model the views do not fit: plain calls
            _put_back(cache, arrays)
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("compiled decode off for this model: %s", self.failed)
            return None
        arrays.clear()
        if self._runs[0] != runs:
            self.traces += 1
        _put_back(cache, out[1:])
        for layer in cache:
            if type(layer) is GrowingBatchKVCache:
                layer._idx += 1
                layer.offset = layer.offset + 1
            elif type(layer) is GrowingKVCache:
                layer.offset += 1
        self.steps += 1
        return out[0]


def _wanted() -> bool:
    """REWIND_COMPILED_DECODE, read at each step; auto means on MLX's CUDA backend."""
    setting = env.compiled_decode()
    if setting == "auto":
        return _on_cuda()
    return setting == "on"


@functools.lru_cache(maxsize=1)
def _on_cuda() -> bool:
    return on_cuda()


Layout = tuple[int, ...]  # per layer: _KV, or how many arrays an ArraysCache holds
_KV = -1
_ATTENTION = "scaled_dot_product_attention"


def _attention_modules(model: Any) -> int:
    """How many modules of `model` have a method, as their class resolves it, that calls the
    module-global scaled_dot_product_attention (mlx-lm's attention layers import it from
    models.base; Rewind's routing wraps such a method, functools.wraps keeps it reachable)."""
    count = 0
    for module in model.modules():
        cls = type(module)
        methods = (inspect.unwrap(inspect.getattr_static(cls, name)) for name in dir(cls))
        if any(isinstance(f, types.FunctionType) and _ATTENTION in f.__code__.co_names
               for f in methods):
            count += 1
    return count


def _full_attention(layer: Any, rows: int) -> bool:
    """A batch cache of full attention; on CUDA also one row's own growing cache (a row
    decoding alone on caches of its own: rewind.engine.runner.lone_rows),
    whose plain call's attention is the same kernel as the view's."""
    return type(layer) is GrowingBatchKVCache or (
        type(layer) is GrowingKVCache and rows == 1 and _on_cuda())


def _held(layer: Any) -> int:
    return layer._idx if type(layer) is GrowingBatchKVCache else layer.offset


def _arrays_of(layer: Any) -> list[Any]:
    if isinstance(layer, (DecodeView, GrowingBatchKVCache, GrowingKVCache)):
        return [layer.keys, layer.values]
    return list(layer.cache)


def _set_arrays(layer: Any, arrays: list[Any]) -> None:
    if isinstance(layer, (GrowingBatchKVCache, GrowingKVCache)):
        layer.keys, layer.values = arrays
    else:
        layer.cache = list(arrays)


def _put_back(cache: list[Any], arrays: list[Any]) -> None:
    at = 0
    for layer in cache:
        count = 2 if isinstance(layer, (GrowingBatchKVCache, GrowingKVCache)) else len(layer.cache)
        _set_arrays(layer, arrays[at:at + count])
        at += count
