"""Answers of a real Engine for tests that compare decoding paths: greedy, log-probabilities on,
end-of-sequence banned (so every answer runs its full length), the prompts submitted together
so that their rows share decode steps."""

from __future__ import annotations

from typing import Any

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams


def greedy_answers(loaded: Any, prompts: list[list[int]], max_tokens: int = 12,
                   timeout: float = 300.0, **config: Any) -> list[list[tuple[int, float]]]:
    """Each prompt's (token, log-probability) pairs from one Engine over `loaded`, built with
    EngineConfig(parallel=len(prompts), **config)."""
    settings = {"parallel": len(prompts), **config}
    with Engine(loaded, EngineConfig(**settings)) as engine:
        no_eos = {int(t): -100.0 for t in engine.eos_token_ids}
        streams = [engine.submit(GenerationRequest(prompt, SamplingParams(
            temperature=0.0, max_tokens=max_tokens, logprobs=True, logit_bias=no_eos)))
            for prompt in prompts]
        results = [stream.collect(timeout) for stream in streams]
    return [list(zip(result.tokens, result.logprobs)) for result in results]
