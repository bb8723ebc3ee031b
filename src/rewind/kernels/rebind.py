"""Point one model's mlx-lm modules at a kernel of ours without touching mlx-lm itself.

mlx-lm's attention and linear-attention modules call module-level functions
(`scaled_dot_product_attention`, `gated_delta_update`) that have no hook. Rebinding those names
in mlx-lm's modules would change them for the whole process: an mlx-lm model or server running
beside Rewind (the benchmarks' mlx-lm rows) would then run Rewind's kernels. Instead, each
module instance of the model Rewind loaded takes a subclass of its class whose methods are
mlx-lm's own code objects, run with globals where that one name is ours. mlx-lm's classes,
functions and other instances stay as shipped.
"""

from __future__ import annotations

import types
from typing import Any

_SUBCLASSES: dict[tuple[type, str, int], type] = {}


def _reads(function: Any, name: str, original: Any) -> bool:
    return (isinstance(function, types.FunctionType) and name in function.__code__.co_names
            and function.__globals__.get(name) is original)


def _subclass(cls: type, name: str, replacement: Any) -> type:
    key = (cls, name, id(replacement))
    if key not in _SUBCLASSES:
        methods: dict[str, Any] = {}
        for attr, function in vars(cls).items():
            if isinstance(function, types.FunctionType) and name in function.__code__.co_names:
                scope = {**function.__globals__, name: replacement}
                copy = types.FunctionType(function.__code__, scope, function.__name__,
                                          function.__defaults__, function.__closure__)
                copy.__kwdefaults__ = function.__kwdefaults__
                copy.__qualname__ = function.__qualname__
                methods[attr] = copy
        # `_rewind_computes_as`: the same function as mlx-lm's class (up to the kernel's
        # float32 rounding), which rewind.kernels.native_forward checks by class.
        _SUBCLASSES[key] = type(cls.__name__, (cls,), {**methods, "_rewind_computes_as": cls})
    return _SUBCLASSES[key]


def swap_function(model: Any, name: str, original: Any, replacement: Any) -> int:
    """Every module of `model` whose class's own methods call `original` as the global `name`
    calls `replacement` instead; returns how many modules changed."""
    changed = 0
    for module in model.modules():
        cls = type(module)
        if any(_reads(function, name, original) for function in vars(cls).values()):
            module.__class__ = _subclass(cls, name, replacement)
            changed += 1
    return changed
