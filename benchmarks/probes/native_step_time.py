"""Time one native-forward decode step of a tiny random Gemma 3 with 18 layers (the default
model's depth): the Python cost around the kernels per step, e.g. the boundary's checks. Every
layer in one C call (step.c), then a layer at a time (three calls a layer), in turn.

    .venv/bin/python benchmarks/probes/native_step_time.py      # best of 5 x 100 steps, in microseconds
"""

from __future__ import annotations

import tempfile
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from rewind.kernels.native_forward import native_forward
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model


def main() -> None:
    folder = build_tiny_model("gemma3", tempfile.mkdtemp(), overrides={"num_hidden_layers": 18})
    model = load_model(str(folder)).model
    forward = native_forward(model)
    assert forward is not None, "the native forward is not installed here"
    cache = make_prompt_cache(model)
    model(mx.array([list(range(3, 200))]), cache=cache)
    token = mx.array([[5]])
    for one_call in (True, False):
        forward.steps_in_one_call = one_call
        for _ in range(20):
            mx.eval(model(token, cache=cache))
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(100):
                mx.eval(model(token, cache=cache))
            best = min(best, (time.perf_counter() - started) / 100)
        how = "one call" if one_call else "a layer at a time"
        print(f"layers {len(forward.layers)}, {how}: decode step {best * 1e6:.0f} us")


if __name__ == "__main__":
    main()
