"""Point one model's mlx-lm modules at a kernel of ours; every other model keeps mlx-lm's.

mlx-lm's attention and linear-attention modules call module-level functions
(`scaled_dot_product_attention`, `gated_delta_update`) that have no hook, from over a hundred
classes. Rebinding such a name to Rewind's kernel outright would change it for the whole
process: an mlx-lm model running beside Rewind (a test's reference, mlx-lm's generate) would
then run Rewind's kernel. Copying mlx-lm's function objects with other globals (what this module
once did) runs code Rewind does not own, and writing a forward of our own for each of those
classes is far more code than the one name it changes.

So the choice is made per call. Each mlx-lm model module that names the function gets, once per
process, a dispatcher under that name (`_dispatcher`): it calls mlx-lm's own function object,
with the same arguments, unless the call comes from inside a module Rewind routed. A routed
module's instance takes a subclass of its mlx-lm class whose methods that call the name are
Rewind's wrappers (`_routed`): they make the module's routes (name -> our function, in a table
keyed by the module) current for the length of mlx-lm's own method, in a context variable, so a
plain model, even in another thread, never sees them. mlx-lm's classes and other instances stay
as shipped, and the only thing that reads a routed module's state is Rewind's code.

`computes_as(cls)` is the mlx-lm class a Rewind-made subclass stands for (rewind.kernels.
native_forward checks layers by exact class), kept here instead of as an attribute on the class.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

from rewind.kernels.object_table import ObjectTable

_NO_ROUTES: Mapping[str, Callable[..., Any]] = types.MappingProxyType({})
# The routes of the routed module whose method is running in this thread, if any.
_CURRENT: ContextVar[Mapping[str, Callable[..., Any]]] = ContextVar("rewind_rebind_routes",
                                                                    default=_NO_ROUTES)
_ROUTES: ObjectTable[Mapping[str, Callable[..., Any]]] = ObjectTable()  # module -> its routes
_DISPATCHERS: dict[tuple[str, int], Callable[..., Any]] = {}  # (name, id(original)) -> one
_SUBCLASSES: dict[tuple[type, frozenset[str]], type] = {}
_ROUTED_FROM: dict[type, type] = {}  # a routed subclass -> its mlx-lm class
_COMPUTES_AS: dict[type, type] = {}  # a Rewind-made subclass -> the mlx-lm class it stands for


def register_stand_in(stand_in: type, mlx_class: type) -> None:
    """Declare that `stand_in` (a subclass of ours) computes what `mlx_class` computes (up to
    float32 rounding)."""
    _COMPUTES_AS[stand_in] = mlx_class


def computes_as(cls: type) -> type:
    """The mlx-lm class `cls` stands for: itself unless it is one of Rewind's stand-ins."""
    return _COMPUTES_AS.get(cls, cls)


def routes(module: Any) -> Mapping[str, Callable[..., Any]]:
    """The functions this module's calls use instead of mlx-lm's, by name (empty: mlx-lm's)."""
    return _ROUTES.get(module) or _NO_ROUTES


def _dispatcher(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    key = (name, id(original))
    if key not in _DISPATCHERS:
        @functools.wraps(original)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            replacement = _CURRENT.get().get(name)
            if replacement is None:
                return original(*args, **kwargs)
            # Ours defers to mlx-lm's function for what its kernel does not take: that call
            # (and anything inside ours) must reach mlx-lm's, not come back here.
            token = _CURRENT.set(_NO_ROUTES)
            try:
                return replacement(*args, **kwargs)
            finally:
                _CURRENT.reset(token)

        _DISPATCHERS[key] = dispatch
    return _DISPATCHERS[key]


def _reads(function: Any, name: str, original: Any) -> bool:
    """`function` is a plain function that calls `original` (or its dispatcher) as `name`."""
    if not (isinstance(function, types.FunctionType) and name in function.__code__.co_names):
        return False
    bound = function.__globals__.get(name)
    return bound is original or bound is _DISPATCHERS.get((name, id(original)))


def _routed(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _CURRENT.set(routes(self))
        try:
            return method(self, *args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return routed


def _subclass(cls: type, names: frozenset[str]) -> type:
    key = (cls, names)
    if key not in _SUBCLASSES:
        methods = {attr: _routed(function) for attr, function in vars(cls).items()
                   if isinstance(function, types.FunctionType)
                   and names & set(function.__code__.co_names)}
        subclass = type(cls.__name__, (cls,), {**methods, "__module__": __name__})
        register_stand_in(subclass, cls)  # the same function, up to the kernel's rounding
        _ROUTED_FROM[subclass] = cls
        _SUBCLASSES[key] = subclass
    return _SUBCLASSES[key]


def swap_function(model: Any, name: str, original: Any, replacement: Any) -> int:
    """Every module of `model` whose class's own methods call `original` as the global `name`
    calls `replacement` instead; returns how many modules changed. Idempotent."""
    changed = 0
    for module in model.modules():
        cls = _ROUTED_FROM.get(type(module), type(module))  # routed before: add to its routes
        readers = [function for function in vars(cls).values()
                   if _reads(function, name, original)]
        if not readers:
            continue
        dispatch = _dispatcher(name, original)
        for function in readers:  # once per mlx-lm module file; the same object after that
            function.__globals__[name] = dispatch
        table = {**routes(module), name: replacement}
        _ROUTES.set(module, types.MappingProxyType(table))
        module.__class__ = _subclass(cls, frozenset(table))
        changed += 1
    return changed
