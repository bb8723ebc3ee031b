"""What one decode step costs on the host in MLX alone: a minimal reproduction for MLX upstream,
with no Rewind code in the loop (mlx and mlx-lm only).

A random-weight bf16 model of Llama-3.2-1B's shape decodes B rows of one length (no mask) the
way mlx-lm's generate loop does: the next step's graph is built and queued with mx.async_eval
before the previous token is read. Per step it reports the time to build the graph (the model's
Python), the time mx.async_eval takes to return (MLX walking the graph and encoding it: on CUDA,
a CUDA graph node per kernel, committed every MLX_MAX_OPS_PER_BUFFER nodes as an updated cached
graph), and the step's wall time. Where wall ~= build + async_eval, the host sets the pace and
the GPU waits. --settings runs each environment (MLX_MAX_OPS_PER_BUFFER, MLX_USE_CUDA_GRAPHS, ...)
in a child process (MLX reads its variables once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LLAMA_1B = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
                tie_word_embeddings=True)
TINY = dict(LLAMA_1B, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)


def measure(batch: int, prompt: int, steps: int, tiny: bool) -> dict[str, float]:
    import mlx.core as mx
    from mlx_lm.models import cache as cache_lib
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(TINY if tiny else LLAMA_1B))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    cache = cache_lib.make_prompt_cache(model)
    tokens = mx.random.randint(0, 4000, (batch, prompt))
    logits = model(tokens, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)

    build = dispatch = 0.0
    walls: list[float] = []
    for step in range(steps + 8):  # 8 steps of warm-up
        start = time.perf_counter()
        next_logits = model(y[:, None], cache=cache)
        next_y = mx.argmax(next_logits[:, -1, :], axis=-1)
        built = time.perf_counter()
        mx.async_eval(next_y)
        queued = time.perf_counter()
        y.tolist()  # the previous step's tokens, read while this one runs
        y = next_y
        end = time.perf_counter()
        if step >= 8:
            build += built - start
            dispatch += queued - built
            walls.append(end - start)
    mx.eval(y)
    walls.sort()
    return {"batch": batch, "build_ms": 1e3 * build / steps, "async_eval_ms": 1e3 * dispatch / steps,
            "wall_ms_median": 1e3 * walls[len(walls) // 2],
            "tok_s": batch / (sum(walls) / len(walls)), "device": str(mx.default_device()),
            "mlx": mx.__version__,
            "setting": os.environ.get("PROBE_SETTING", "default")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/mlx_step_host_cost.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ops-per-buffer", nargs="*", default=[],
                        help="MLX_MAX_OPS_PER_BUFFER values, each in a child process")
    parser.add_argument("--settings", nargs="*", default=[],
                        help="environments, each in a child process: 'default' or "
                             "NAME=VALUE[,NAME=VALUE] (MLX reads its variables once), e.g. "
                             "MLX_USE_CUDA_GRAPHS=0")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer model (a check the probe runs)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = args.settings + [f"MLX_MAX_OPS_PER_BUFFER={v}" for v in args.ops_per_buffer]
    if args.one or not settings:
        rows = [measure(b, args.prompt_tokens, args.steps, args.tiny) for b in args.batches]
        if args.one:
            print(json.dumps(rows))
            return
    else:
        rows = []
        for setting in settings:
            variables = {} if setting == "default" else dict(
                item.split("=", 1) for item in setting.split(","))
            argv = [sys.executable, __file__, "--one", "--batches", *map(str, args.batches),
                    "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps)]
            argv += ["--tiny"] if args.tiny else []
            done = subprocess.run(argv, env={**os.environ, **variables, "PROBE_SETTING": setting},
                                  capture_output=True, text=True, check=True)
            rows += json.loads(done.stdout.strip().splitlines()[-1])
    for row in rows:
        print(f"B={row['batch']:<3} {row['setting']:<34} build "
              f"{row['build_ms']:.2f} ms  async_eval {row['async_eval_ms']:.2f} ms  step "
              f"{row['wall_ms_median']:.2f} ms  {row['tok_s']:.0f} tok/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
