"""On the CPU, the families that run MLX's layers (Qwen 3.5, Gemma 4) give a row the same bits
whether it decodes alone or in a merged batch with rows of other lengths, as the CPU kernels'
families do: with bf16 weights every matrix product runs in the C kernel, row by row, and
Rewind's attention kernel visits a left-padded row's keys by their positions from its oldest
(rewind.kernels.cpu_attention: mlx-lm's BatchKVCache, its sliding-window ring, and Gemma 4's
layers that read another layer's keys). Before, a padded row's keys fell into other blocks of
the online softmax, and its log-probabilities moved in the last bits with its neighbours."""

from __future__ import annotations

import random

import pytest

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams

TIMEOUT = 600


def params(engine: Engine) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40, logprobs=True, top_logprobs=3,
                          logit_bias={int(t): -100.0 for t in engine.eos_token_ids})


@pytest.mark.cpu_only
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_a_row_decodes_the_same_bits_alone_and_batched(bf16_loaded, family):
    loaded = bf16_loaded(family)
    rng = random.Random(5)
    # Gemma 4's windows hold 64 tokens: the rows wrap their rings at different places.
    prompts = [[rng.randrange(10, 500) for _ in range(n)] for n in (50, 150, 230)]
    with Engine(loaded, EngineConfig(parallel=3, chunk_tokens=32, speculative="off")) as engine:
        alone = [engine.submit(GenerationRequest(p, params(engine))).collect(TIMEOUT)
                 for p in prompts]
        handles = [engine.submit(GenerationRequest(p, params(engine))) for p in prompts]
        together = [h.collect(TIMEOUT) for h in handles]
    for one, other in zip(alone, together):
        assert one.tokens == other.tokens
        assert one.logprobs == other.logprobs
    assert len({tuple(r.tokens[:5]) for r in alone}) == len(prompts)
