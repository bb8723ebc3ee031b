"""Where mlx-lm's linear attention layers (Qwen 3.5, Qwen3-Next) run the gated delta rule.

mlx-lm runs the recurrence in a Metal kernel, and on every other backend in `gated_delta_ops`:
a Python loop that builds and evaluates a graph per token per layer (about half of a Qwen 3.5
0.8B-sized prefill on 2 CPU cores; 470 tokens/s for a 2B one on an H200). `use_in_model(model)`
points the model's modules at `gated_delta_update` below, which takes mlx-lm's arguments,
computes the gates with mlx-lm's own functions and runs the recurrence in Rewind's C kernel on
the CPU (rewind.kernels.cpu_gated_delta) or its CUDA kernel on NVIDIA GPUs
(rewind.kernels.cuda_gated_delta); on Metal, for shapes a kernel does not take, and with
REWIND_GATED_DELTA=off it is mlx-lm's function.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from rewind import env

log = logging.getLogger(__name__)

ENV = env.GATED_DELTA.name  # "off": mlx-lm's own path (read at each call, so tests can compare)
_failed: set[str] = set()  # kernels that raised once: not tried again in this process
_checked: set[str] = set()  # kernels that ran once (a CUDA kernel compiles when first evaluated)


# Called with each call's state, its arguments and this function, to call again with fewer
# positions (rewind.cache.linear_steps records a drafting row's call through it); None: nobody
# listens.
Observer = Callable[[Any, dict[str, Any], Callable[..., Any]], None]
_observer: Observer | None = None


def observe(observer: Observer | None) -> None:
    """Hand every call's (state, arguments, this function) to `observer` from now on (None: to
    nobody)."""
    global _observer
    _observer = observer


def tracing(exc: BaseException) -> bool:
    """Whether `exc` is MLX refusing to evaluate inside a function transformation (mx.compile):
    the call cannot run there, which says nothing about the kernel."""
    return "function transformations" in str(exc)


def _recurrence(q: mx.array) -> tuple[str, Callable[..., tuple[mx.array, mx.array]]] | None:
    if env.gated_delta_off():
        return None
    from rewind.kernels import cpu_gated_delta, cuda_gated_delta

    if "cpu" not in _failed and cpu_gated_delta.available():
        return "cpu", cpu_gated_delta.recurrence
    if "cuda" not in _failed and cuda_gated_delta.available() and cuda_gated_delta.supported(q):
        return "cuda", cuda_gated_delta.recurrence
    return None


def gated_delta_update(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                       A_log: mx.array, dt_bias: mx.array, state: mx.array | None = None,
                       mask: mx.array | None = None, *, use_kernel: bool = True,
                       lower_bound: float | None = None,
                       allow_neg_eigval: bool = False) -> tuple[mx.array, mx.array]:
    """mlx_lm.models.gated_delta.gated_delta_update, with the recurrence in Rewind's kernel for
    this backend where there is one."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    if _observer is not None:  # a drafting row's call keeps what taking tokens back needs
        _observer(state, {
            "q": q, "k": k, "v": v, "a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias,
            "mask": mask, "use_kernel": use_kernel, "lower_bound": lower_bound,
            "allow_neg_eigval": allow_neg_eigval}, gated_delta_update)
    chosen = _recurrence(q) if use_kernel else None
    if chosen is not None:
        name, recurrence = chosen
        # The gates exactly as mlx-lm computes them; only the recurrence moves.
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        if lower_bound is None:
            g = mlx_gated_delta.compute_g(A_log, a, dt_bias)
        else:
            g = mlx_gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        if state is None:
            batch, _, _, key_dim = q.shape
            value_heads, value_dim = v.shape[-2:]
            state = mx.zeros((batch, value_heads, value_dim, key_dim), dtype=mx.float32)
        result = None
        try:
            result = recurrence(q, k, v, g, beta, state, mask)
            if name not in _checked:
                mx.eval(result)
                _checked.add(name)
            return result
        except (RuntimeError, ValueError) as exc:
            if not tracing(exc):  # e.g. the CUDA compiler refusing the source
                _failed.add(name)
                log.warning("gated delta: Rewind's %s kernel failed (%s); using mlx-lm's path",
                            name, exc)
            elif result is not None:  # traced (mx.compile) before its first check: kept
                return result
            # else a kernel that computes on the host, inside mx.compile (rewind.engine
            # .compiled_decode): mlx-lm's ops for this trace, the kernel on for every other call
    return mlx_gated_delta.gated_delta_update(
        q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
        lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)


def use_in_model(model: Any) -> int:
    """This model's modules that call mlx-lm's gated_delta_update call this one instead
    (rewind.kernels.rebind: any other model still calls mlx-lm's); returns how many modules
    changed."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    from rewind.kernels.rebind import swap_function

    return swap_function(model, "gated_delta_update", mlx_gated_delta.gated_delta_update,
                         gated_delta_update)
