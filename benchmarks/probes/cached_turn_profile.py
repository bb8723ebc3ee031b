"""Where a cached turn's time to first token goes, in the engine the server runs (prompt cache
with its RAM tier and disk file, the load-time warm-up on GPUs), step by step and by function.

cProfile wraps each of the engine thread's steps while a cached turn runs, so it sees every
call of the step, and MLX's waits show up in the function that waited (`mx.eval`, `.item()`,
`.tolist()`, a copy to the host). Requests: a cold prompt, then that prompt plus a new tail
(the cached turn), then a second cold prompt and its cached turn (the same shapes again).
`--prefixes 2900,3200` runs the rounds at those prefix lengths instead: whether a first cached
turn's one-off cost is paid once per exact call shape, or once for calls at contexts near it
(what a warm-up at a long context would then remove).

    PYTHONPATH=src python benchmarks/probes/cached_turn_profile.py [--shape qwen3.5-0.8b]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class ProfiledSteps:
    """Engine.step on the engine thread, under `profile` while one is set."""

    def __init__(self, engine: Any) -> None:
        self.step = engine.step
        self.profile: cProfile.Profile | None = None
        engine.step = self

    def __call__(self) -> bool:
        profile = self.profile
        return profile.runcall(self.step) if profile is not None else self.step()


def run_request(engine: Any, steps_hook: ProfiledSteps, prompt: list[int],
                profile: cProfile.Profile | None) -> dict[str, Any]:
    from rewind.engine.request import GenerationRequest, SamplingParams

    steps: list[dict[str, float]] = []

    def on_step(plan: Any, timing: Any) -> None:
        steps.append({"schedule_ms": round(timing.schedule_ms, 2), "run_ms": round(timing.run_ms, 2),
                      "postprocess_ms": round(timing.postprocess_ms, 2),
                      "prefill_tokens": sum(c.end - c.start for c in plan.prefill)})

    engine.add_step_listener(on_step)
    started = time.perf_counter()
    steps_hook.profile = profile
    handle = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    handle.collect(timeout=120)
    steps_hook.profile = None
    seconds = time.perf_counter() - started
    engine.remove_step_listener(on_step)
    return {"seconds": round(seconds, 4), "cached_tokens": handle.usage.cached_tokens,
            "restore_seconds": round(handle.usage.restore_seconds, 4), "steps": steps}


def main() -> int:
    from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_model, make_prompts
    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine
    from rewind.engine.warm_up import warm_up

    parser = argparse.ArgumentParser(prog="python benchmarks/probes/cached_turn_profile.py", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.5-0.8b", help=", ".join({**SHAPES, **QUICK_SHAPES}))
    parser.add_argument("--prefix", type=int, default=3200)
    parser.add_argument("--prefixes", default="",
                        help="comma-separated prefix lengths, one round each (default: --prefix twice)")
    parser.add_argument("--tail", type=int, default=155)
    parser.add_argument("--top", type=int, default=25, help="functions listed by own time")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    family, overrides = {**SHAPES, **QUICK_SHAPES}[args.shape]
    work = Path(tempfile.gettempdir()) / "rewind-probe-models"
    loaded = build_model(args.shape, family, overrides, work)
    vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
    config = EngineConfig()
    warm_up(loaded, config, CacheConfig())  # as the server does: a cached turn included
    scratch = Path(tempfile.mkdtemp(prefix="rewind-probe-cache-"))
    cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(cache_dir=scratch))
    engine = Engine(loaded, config, cache)
    steps_hook = ProfiledSteps(engine)
    engine.start()
    prefixes = ([int(p) for p in args.prefixes.split(",")] if args.prefixes
                else [args.prefix, args.prefix])
    results: dict[str, Any] = {"shape": args.shape, "prefixes": prefixes, "tail": args.tail,
                               "requests": []}
    profiles: list[str] = []
    for round_, prefix in enumerate(prefixes, start=1):
        cold = make_prompts(1, prefix, vocab, 100 * round_)[0]
        tail = make_prompts(1, args.tail, vocab, 100 * round_ + 1)[0]
        for label, prompt in (("cold", cold), ("cached turn", cold + tail)):
            profile = cProfile.Profile() if label == "cached turn" else None
            row = run_request(engine, steps_hook, prompt, profile)
            row.update(round=round_, request=label, prompt_tokens=len(prompt))
            results["requests"].append(row)
            print(f"round {round_}, {label} ({len(prompt)} tokens): {row['seconds'] * 1000:.1f} ms, "
                  f"{row['cached_tokens']} cached, restore {row['restore_seconds'] * 1000:.1f} ms, "
                  f"{len(row['steps'])} steps: {row['steps'][:3]}{' ...' if len(row['steps']) > 3 else ''}")
            if profile is not None:
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats("tottime").print_stats(args.top)
                stats.sort_stats("cumulative").print_stats(args.top)
                profiles.append(f"## round {round_}, {label}\n{text.getvalue()}")
    engine.shutdown()
    cache.close()
    print("\n".join(profiles))
    if args.json:
        results["profiles"] = profiles
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
