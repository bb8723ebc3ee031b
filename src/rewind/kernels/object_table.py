"""ObjectTable: per-object state of ours for objects we do not own (mlx-lm's models and modules),
kept beside them instead of as attributes on them. An entry holds a weak reference's worth: it
goes when its object is garbage-collected (an unloaded model of the model pool), so a table never
keeps weights alive."""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

Value = TypeVar("Value")


class ObjectTable(Generic[Value]):
    """object -> value, for objects that cannot carry attributes of ours; entries die with
    their object."""

    def __init__(self) -> None:
        self._values: dict[int, Value] = {}

    def set(self, key: Any, value: Value) -> None:
        ident = id(key)
        if ident not in self._values:
            weakref.finalize(key, self._values.pop, ident, None)
        self._values[ident] = value

    def get(self, key: Any) -> Value | None:
        return self._values.get(id(key))

    def pop(self, key: Any) -> Value | None:
        return self._values.pop(id(key), None)
