"""Speculative decoding on a GPU through the engine, one request at a time: `--speculative off`
against `suffix`, on a random Llama-3.2-1B-shaped bf16 model (rewind.kernels.cuda_rows makes a
drafted row's check exact on CUDA).

Random weights cannot say how often real drafts are kept, so two cases bound it:
- "asked again": a prompt whose answer the engine gave before: the suffix pool drafts that
  answer and the model keeps all of it (an agent re-sending a file it just wrote is close);
- "new prompt": random ids never seen: drafts find little, and what they cost shows (the steps
  also leave MLX's compiled, pipelined decode for plain calls while drafting is possible).
Times after the first token and tokens/s; drafted and kept tokens; whether the answers match.

    PYTHONPATH=src python benchmarks/probes/gpu_speculation.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def one(engine: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    from rewind.engine import GenerationRequest, SamplingParams
    from rewind.engine.request import TokenEvent

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            logit_bias={int(t): -100.0 for t in engine.eos_token_ids})
    started = time.perf_counter()
    handle = engine.submit(GenerationRequest(prompt, params))
    first = None
    tokens = []
    for event in handle.events(600):
        if isinstance(event, TokenEvent):
            if first is None:
                first = time.perf_counter()
            tokens.append(event.token)
    done = time.perf_counter()
    after = done - (first or done)
    return {"tokens": len(tokens), "ttft_s": (first or done) - started, "after_first_s": after,
            "tokens_per_s": (len(tokens) - 1) / after if after > 0 else None,
            "answer": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python benchmarks/probes/{Path(__file__).name}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_model
    from rewind.config import EngineConfig
    from rewind.engine import Engine

    name = "llama-tiny" if args.quick else "llama-3.2-1b"
    family, overrides = {**SHAPES, **QUICK_SHAPES}[name]
    loaded = build_model(name, family, overrides, Path(tempfile.gettempdir()) / "rewind-probe-models")
    vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(16, min(vocab, 30000)) for _ in range(args.context)]

    prompts = [prompt() for _ in range(3)]
    out: dict[str, Any] = {"model": name, "context": args.context, "max_tokens": args.max_tokens}
    answers: dict[str, list[list[int]]] = {}
    for mode in ("off", "suffix", "off", "suffix"):
        with Engine(loaded, EngineConfig(parallel=1, speculative=mode)) as engine:
            exact = engine._scheduler.runner.lone_rows_exact
            rows = []
            one(engine, prompts[2][:300], 16)  # the engine's first shapes, not timed
            for index, case in ((0, "new prompt"), (0, "asked again"), (1, "new prompt"),
                                (1, "asked again")):
                speculator = engine._scheduler.speculator
                before = (0, 0) if speculator is None else (
                    speculator.counters.drafted_tokens, speculator.counters.accepted_tokens)
                row = one(engine, prompts[index], args.max_tokens)
                after = (0, 0) if speculator is None else (
                    speculator.counters.drafted_tokens, speculator.counters.accepted_tokens)
                row.update({"case": case, "prompt": index, "drafted": after[0] - before[0],
                            "kept": after[1] - before[1]})
                answers.setdefault(mode, []).append(row.pop("answer"))
                rows.append(row)
                print(json.dumps({"mode": mode, **row}), flush=True)
        out.setdefault("runs", []).append({"mode": mode, "rows_exact": exact, "rows": rows})
    out["answers_match"] = answers["off"] == answers["suffix"]
    print("answers match:", out["answers_match"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
