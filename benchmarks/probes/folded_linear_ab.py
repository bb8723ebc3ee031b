"""Decode tokens/s of Rewind's engine with its linear layers folded (rewind.kernels.folded_linear)
and without, interleaved in one process, at 1, 8 and 32 streams: what the fold itself buys.

    PYTHONPATH=src python benchmarks/probes/folded_linear_ab.py [--models llama-3.2-1b qwen3.5-0.8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any


def main() -> int:
    import mlx.core as mx

    from rewind.bench.decode_scaling_engine import run_engine
    from rewind.bench.decode_scaling_models import (
        QUICK_SHAPES, SHAPES, build_model, eos_ids, make_prompts)
    from rewind.config import EngineConfig
    from rewind.engine import Engine
    from rewind.kernels import folded_linear

    parser = argparse.ArgumentParser(prog="python benchmarks/probes/folded_linear_ab.py", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen3.5-0.8b"])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "rewind-probe-models")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name in args.models:
        family, overrides = {**SHAPES, **QUICK_SHAPES}[name]
        loaded = build_model(name, family, overrides, args.work_dir)
        vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
        bias = {t: -100.0 for t in eos_ids(loaded)}
        engine = Engine(loaded, EngineConfig(parallel=max(args.streams))).start()
        chunk = engine.runner.chunk_tokens
        seed = 0
        try:
            run_engine(engine, make_prompts(max(args.streams), 64, vocab, 999), 8, chunk, bias)
            for round_ in range(args.rounds):
                for count in args.streams:
                    for folded in (True, False):
                        seed += 1
                        prompts = make_prompts(count, args.prompt_tokens, vocab, seed)
                        with nullcontext() if folded else folded_linear.stepped_aside():
                            result = run_engine(engine, prompts, args.decode_tokens, chunk, bias)
                        row = {"model": name, "round": round_, "streams": count,
                               "folded": folded, "tok_s": result["tok_s"],
                               "step_ms": result["per_step"].get("step_ms")}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            engine.shutdown()
        del engine, loaded
        mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
