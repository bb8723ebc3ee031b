"""The kernel backend: picked once per process, the one seam between the engine and the kernels.

`select()` names the backend MLX computes on here ("cpu": Rewind's C kernels; "cuda": its CUDA
kernel for the gated delta rule; "metal": mlx-lm's own). What a backend set up for one model
(its backbone pass and output head on the CPU) is kept in the backend's own tables, keyed by the
model object, never as attributes on mlx-lm's objects; `kernels_for(model)` hands it out as a
`ModelKernels`, which the runner is given (rewind.engine.runner.ModelRunner).

Tables (rewind.kernels.object_table) hold a weak reference's worth: an entry goes when its model
is garbage-collected (an unloaded model of the model pool), so they never keep weights alive.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from rewind.kernels.fast_head import fast_head
from rewind.kernels.model_split import split_model
from rewind.kernels.native_forward import native_forward


@dataclass(frozen=True)
class ModelKernels:
    """What runs one model's forward pass outside MLX's own layers."""

    forward: Any = None  # rewind.kernels.native_forward.NativeForward: the backbone in C
    head: Any = None  # rewind.kernels.fast_head.CpuHead: the output head in C

    @property
    def fuses_segments(self) -> bool:
        """Several token blocks (decode rows, prefill chunks) can share one forward pass."""
        return self.forward is not None


@dataclass(frozen=True)
class KernelBackend:
    name: str  # cpu | cuda | metal

    def kernels_for(self, model: Any) -> ModelKernels:
        if self.name != "cpu":
            return ModelKernels()
        split = split_model(model)
        return ModelKernels(forward=None if split is None else native_forward(model),
                            head=fast_head(model))


@functools.cache
def select() -> KernelBackend:
    """This process's backend (MLX's default device does not change once a process computes)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return KernelBackend("cpu")
    return KernelBackend("metal" if mx.metal.is_available() else "cuda")


def kernels_for(model: Any) -> ModelKernels:
    return select().kernels_for(model)
