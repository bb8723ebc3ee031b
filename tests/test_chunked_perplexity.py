"""rewind.models.quality.chunked_perplexity: llama-perplexity's method (chunks of n_ctx tokens, BOS
first, each from scratch, the second half scored), checked against a direct computation on tiny
random models, and the bench's reading of llama-perplexity's output (issue 25)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from rewind.bench.perplexity import parse_llama_perplexity
from rewind.models.quality import chunked_perplexity, perplexity_chunks, token_log_likelihoods

BOS = 2


def test_chunks_are_whole_n_ctx_runs_with_bos_first_and_the_rest_dropped() -> None:
    tokens = [BOS, *range(10, 10 + 2 * 8 + 4)]  # 21 tokens: two chunks of 8, five left over
    assert perplexity_chunks(tokens, 8, BOS) == [[BOS, *range(10, 17)], [BOS, *range(18, 25)]]
    # A model that adds no BOS: the chunks are the tokens as they are.
    assert perplexity_chunks(tokens, 8, None) == [tokens[:8], tokens[8:16]]
    with pytest.raises(ValueError, match="at least 16"):
        perplexity_chunks(tokens[:15], 8, BOS)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_chunked_perplexity_is_llama_perplexitys_estimate_computed_directly(
        tiny_loaded, family) -> None:
    model = tiny_loaded(family).model
    vocab = int(model.args.vocab_size)
    n_ctx = 80  # longer than gemma3's tiny sliding window (64)
    rng = random.Random(25)
    tokens = [BOS] + [rng.randrange(3, vocab) for _ in range(3 * n_ctx + 9)]

    result = chunked_perplexity(model, tokens, n_ctx, BOS)

    # Directly: each chunk is BOS + the next n_ctx - 1 tokens after the chunk's first, scored
    # through the model's full call from the middle on: the tokens at n_ctx/2 + 1 .. n_ctx - 1.
    first = n_ctx // 2
    per_chunk = []
    for start in range(0, 3 * n_ctx, n_ctx):
        chunk = [BOS, *tokens[start + 1:start + n_ctx]]
        log_likelihoods = token_log_likelihoods(model, chunk)  # of chunk[1:], from chunk[:-1]
        per_chunk.append([-value for value in log_likelihoods[first:]])
    assert [len(nlls) for nlls in per_chunk] == [n_ctx - first - 1] * 3
    nlls = np.array([value for chunk in per_chunk for value in chunk], dtype=np.float64)
    expected = math.exp(nlls.mean())
    # llama-perplexity's +/-: the population variance of the NLL over count - 1, times the PPL.
    expected_error = expected * math.sqrt(nlls.var() / (len(nlls) - 1))

    assert result.scored == len(nlls) and result.text_tokens == len(tokens)
    assert result.ppl == pytest.approx(expected, rel=1e-4)
    assert result.error == pytest.approx(expected_error, rel=1e-3)
    assert result.chunk_ppl == pytest.approx(
        [math.exp(np.mean(chunk)) for chunk in per_chunk], rel=1e-4)
    assert result.running == pytest.approx(
        [math.exp(np.mean(np.concatenate(per_chunk[:i + 1]))) for i in range(3)], rel=1e-4)
    assert result.running[-1] == pytest.approx(result.ppl)

    # The chunk's first token is BOS, not the text's: another first token changes nothing, while
    # a token in the scored half does; a chunk is evaluated on its own.
    changed = list(tokens)
    changed[n_ctx] = (changed[n_ctx] + 1 - 3) % (vocab - 3) + 3  # chunk 2's first token
    assert chunked_perplexity(model, changed, n_ctx, BOS).ppl == pytest.approx(result.ppl,
                                                                               rel=1e-6)
    changed[n_ctx + first + 3] = (changed[n_ctx + first + 3] + 1 - 3) % (vocab - 3) + 3
    assert chunked_perplexity(model, changed, n_ctx, BOS).ppl != pytest.approx(result.ppl,
                                                                               rel=1e-6)
    # max_chunks: the first chunks only, as llama-perplexity's --chunks.
    assert chunked_perplexity(model, tokens, n_ctx, BOS, max_chunks=2).ppl == pytest.approx(
        result.running[1], rel=1e-6)


LLAMA_PERPLEXITY_OUTPUT = """\
0.04.802.508 I perplexity: calculating perplexity over 3 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.34.014.132 I perplexity: 29.21 seconds per pass - ETA 0.45 minutes
[1]13.0142,[2]13.8935,[3]13.8515,
5.31.867.220 I Final estimate: PPL = 13.8515 +/- 0.34585
"""


def test_llama_perplexitys_final_estimate_and_running_values_are_read() -> None:
    parsed = parse_llama_perplexity(LLAMA_PERPLEXITY_OUTPUT)
    assert parsed == {"ppl": 13.8515, "error": 0.34585, "running": [13.0142, 13.8935, 13.8515],
                      "chunks": 3, "n_ctx": 512}
    with pytest.raises(ValueError, match="Final estimate"):
        parse_llama_perplexity("perplexity: tokenizing the input ..\n")
