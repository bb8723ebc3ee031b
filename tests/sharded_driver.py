"""One rank of a sharded engine under `mlx.launch`, for tests/test_sharded.py; and the scenario
that the test runs again in a single process to compare.

    mlx.launch --backend ring -n 2 -- python tests/sharded_driver.py MODEL OUT [--pipeline]

Rank 0 runs the scenario through its LeaderEngine and writes OUT/results.json; every rank writes
its prompt cache's stats to OUT/rank-R.json once rank 0 has stopped.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from rewind.engine import GenerationRequest, SamplingParams


def prompts(vocab: int = 512, seed: int = 7) -> dict[str, list[int]]:
    """Token prompts: one crossing a 256-token block (checkpointed there and at its end), three
    of other lengths for a batch. Ids from the middle of the vocabulary (no special tokens)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, vocab - 16) for _ in range(n)]

    return {"alone": ids(300), "b1": ids(40), "b2": ids(170), "b3": ids(290)}


def request(tokens: list[int], max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=tokens, checkpoints=[len(tokens) - 1, len(tokens)],
                             params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   logprobs=True, top_logprobs=4))


def outcome(completion: Any) -> dict[str, Any]:
    return {"tokens": completion.tokens, "logprobs": completion.logprobs,
            "cached": completion.finish.usage.cached_tokens,
            "finish": completion.finish.reason}


def scenario(engine: Any, vocab: int = 512) -> dict[str, Any]:
    """Alone, batched, then cached: the same prompt again, and its second turn (the prompt, the
    answer and new tokens), which restores past the first turn's block."""
    given = prompts(vocab)
    results = {"alone": outcome(engine.generate(request(given["alone"]), timeout=600))}
    handles = {name: engine.submit(request(given[name])) for name in ("b1", "b2", "b3")}
    for name, handle in handles.items():
        results[name] = outcome(handle.collect(timeout=600))
    results["repeat"] = outcome(engine.generate(request(given["alone"]), timeout=600))
    second = given["alone"] + results["alone"]["tokens"] + prompts(vocab, seed=8)["b1"]
    results["second_turn"] = outcome(engine.generate(request(second), timeout=600))
    return results


def main(model: str, out: Path, layout: str) -> int:
    from rewind.config import CacheConfig, EngineConfig
    from rewind.parallel.group import world
    from rewind.parallel.serving import build_rank_engine, load_shard

    group = world()
    assert group is not None, "run under mlx.launch with two or more processes"
    loaded = load_shard(model, group, layout)
    config = EngineConfig(parallel=4, cache=CacheConfig(cache_dir=out / "cache",
                                                        disk_bytes=64 << 20))
    engine, prompt_cache = build_rank_engine(loaded, config, group, layout)
    if group.rank() == 0:
        engine.start()
        try:
            vocab = int(loaded.config.get("vocab_size") or 512)
            results = scenario(engine, vocab)
        finally:
            engine.shutdown()  # tells the other ranks to stop
        (out / "results.json").write_text(json.dumps(results))
    else:
        engine.run()
    from rewind.cache.kv import make_cache

    report = {**prompt_cache.stats(), "fingerprint": loaded.fingerprint,
              "cache_dir": str(prompt_cache.config.cache_dir),
              # This rank's per-layer caches: every layer under tensor parallelism, only its
              # stage's under pipeline parallelism.
              "cache_layers": [type(layer).__name__ for layer in make_cache(loaded.model)]}
    (out / f"rank-{group.rank()}.json").write_text(json.dumps(report, default=str))
    prompt_cache.close()
    return 0


if __name__ == "__main__":
    layout = "pipeline" if "--pipeline" in sys.argv else "tensor"
    args = [a for a in sys.argv[1:] if a != "--pipeline"]
    sys.exit(main(args[0], Path(args[1]), layout))
