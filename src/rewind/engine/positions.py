"""Explicit rotary positions for models whose positions are not the cache offset.

Qwen-VL-style language models rotate image tokens by 3-D (temporal, height, width) positions and
shift the text after an image (multimodal rotary positions, "mrope"). mlx-lm's attention layers
ask their rope for `offset=cache.offset` only, so positions cannot travel as a model argument
through mlx-lm's classes. rewind.vision.mrope replaces those rope modules with ones that read
the positions of the current model call from the model's `RopePositions`, kept in a table of
ours keyed by the model (never an attribute on mlx-lm's object); the scheduler sets them around
each call with `given_positions`. On every other model nothing is installed
and `given_positions` does nothing.

Engine thread only (the one thread that calls the model). The positions are read while the
call builds its graph, so clearing them after the call is safe with MLX's lazy evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rewind.kernels.object_table import ObjectTable


class RopePositions:
    """The position ids [3, B, L] of the model call in progress, or None (offset-based)."""

    def __init__(self) -> None:
        self.current: Any = None
        self.memo: dict[Any, Any] = {}  # per-call values shared by every layer (cos/sin)

    def set(self, positions: Any) -> None:
        self.current = positions
        self.memo.clear()

    def clear(self) -> None:
        self.current = None
        self.memo.clear()


# model -> its holder; the entry goes with the model (an unloaded model of the pool).
_HOLDERS: ObjectTable[RopePositions] = ObjectTable()


def positions_holder(model: Any) -> RopePositions | None:
    """The model's holder when explicit positions were installed (rewind.vision.mrope)."""
    return _HOLDERS.get(model)


def install_positions_holder(model: Any) -> RopePositions:
    holder = positions_holder(model)
    if holder is None:
        holder = RopePositions()
        _HOLDERS.set(model, holder)
    return holder


def takes_positions(model: Any) -> bool:
    return positions_holder(model) is not None


@contextmanager
def given_positions(model: Any, positions: Any) -> Iterator[None]:
    """Run the model calls inside with `positions` ([3, B, L] int32); a no-op when the model
    has no holder or `positions` is None."""
    holder = positions_holder(model)
    if holder is None or positions is None:
        yield
        return
    holder.set(positions)
    try:
        yield
    finally:
        holder.clear()
