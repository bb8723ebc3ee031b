"""Time one native-forward decode step: the Python cost around the kernels per step, e.g. the
boundary's checks. By default a tiny random Gemma 3 with 18 layers (the default model's depth),
every layer in one C call (step.c), then a layer at a time (three calls a layer), in turn;
`--model default` times the default model as served (its GGUF's blocks in place, logits
included) after a `--context`-token prompt.

    .venv/bin/python benchmarks/probes/native_step_time.py      # best of 5 x 100 steps, in microseconds
    .venv/bin/python benchmarks/probes/native_step_time.py --model default --context 1000

Two versions side by side: a `git worktree add /tmp/base <rev>` beside the change, and each run
in turn with PYTHONPATH=/tmp/base/src or PYTHONPATH=src (the kernels' library is shared: the
same C sources build once).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from rewind.kernels.native_forward import native_forward
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/native_step_time.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a registry name or folder (default: a tiny "
                        "18-layer random Gemma 3)")
    parser.add_argument("--context", type=int, default=197, help="prompt tokens before the steps")
    parser.add_argument("--steps", type=int, default=100, help="steps a timed round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the best is reported")
    args = parser.parse_args()
    if args.model:
        model = load_model(args.model).model
    else:
        folder = build_tiny_model("gemma3", tempfile.mkdtemp(),
                                  overrides={"num_hidden_layers": 18})
        model = load_model(str(folder)).model
    forward = native_forward(model)
    assert forward is not None, "the native forward is not installed here"
    cache = make_prompt_cache(model)
    model(mx.array([list(range(3, 3 + args.context))]), cache=cache)
    token = mx.array([[5]])
    for one_call in (True, False):
        forward.steps_in_one_call = one_call
        for _ in range(20):
            mx.eval(model(token, cache=cache))
        best = float("inf")
        for _ in range(args.rounds):
            started = time.perf_counter()
            for _ in range(args.steps):
                mx.eval(model(token, cache=cache))
            best = min(best, (time.perf_counter() - started) / args.steps)
        how = "one call" if one_call else "a layer at a time"
        print(f"layers {len(forward.layers)}, {how}: decode step {best * 1e6:.0f} us")


if __name__ == "__main__":
    main()
