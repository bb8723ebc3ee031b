"""SequenceSampler and sample_rows on hand-made logits: every knob moves the distribution the way
it should, seeds reproduce, logprobs are the log-softmax of the processed logits."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import pytest

from rewind.engine.request import InvalidRequestError, SamplingParams
from rewind.engine.sampler import SequenceSampler, sample_rows

LOGITS = [2.0, 1.0, 0.5, -1.0, -3.0, 0.0]
VOCAB = len(LOGITS)


def sampler(**kw) -> SequenceSampler:
    return SequenceSampler(SamplingParams(**kw), prompt_tokens=[], vocab_size=VOCAB)


def draws(s: SequenceSampler, n: int, logits: list[float] = LOGITS) -> Counter[int]:
    row = mx.array(logits)
    tokens = [s.draw(s.process(row)) for _ in range(n)]
    mx.eval(tokens)  # one evaluation for all draws: the key chain is part of the graph
    return Counter(int(t.item()) for t in tokens)


def test_greedy_takes_the_argmax_and_logit_bias_moves_it():
    assert draws(sampler(temperature=0), 3) == Counter({0: 3})
    assert draws(sampler(temperature=0, logit_bias={4: 10.0}), 3) == Counter({4: 3})
    assert draws(sampler(temperature=0, logit_bias={0: -100.0}), 3) == Counter({1: 3})


def test_repetition_penalty_is_sign_aware_over_prompt_and_output():
    s = SequenceSampler(SamplingParams(repetition_penalty=2.0), prompt_tokens=[0, 3],
                        vocab_size=VOCAB)
    s.accept(1)
    out = s.process(mx.array(LOGITS)).tolist()
    assert out == pytest.approx([1.0, 0.5, 0.5, -2.0, -3.0, 0.0])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    s = SequenceSampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                        prompt_tokens=[2], vocab_size=VOCAB)
    for token in (0, 0, 1):
        s.accept(token)
    out = s.process(mx.array(LOGITS)).tolist()
    assert out == pytest.approx([2.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 0.5, -1.0, -3.0, 0.0])


def test_temperature_sampling_follows_the_softmax():
    counts = draws(sampler(temperature=1.0, seed=3), 1000)
    probs = mx.softmax(mx.array(LOGITS)).tolist()
    for token, p in enumerate(probs):
        assert counts[token] / 1000 == pytest.approx(p, abs=0.05)


def test_low_temperature_sharpens():
    hot = draws(sampler(temperature=2.0, seed=1), 300)[0]
    cold = draws(sampler(temperature=0.3, seed=1), 300)[0]
    assert cold > hot


def test_top_k_top_p_min_p_truncate_the_support():
    assert set(draws(sampler(top_k=2, seed=1), 100)) == {0, 1}
    # softmax(LOGITS) ~ [.55, .20, .12, .03, .004, .07]: top_p 0.7 keeps tokens 0 and 1.
    assert set(draws(sampler(top_p=0.7, seed=2), 100)) == {0, 1}
    assert set(draws(sampler(top_p=0.05, seed=2), 20)) == {0}
    # min_p 0.2: keep tokens with p >= 0.2 * p(0) ~ 0.11, i.e. tokens 0, 1 and 2.
    assert set(draws(sampler(min_p=0.2, seed=3), 200)) == {0, 1, 2}
    assert set(draws(sampler(temperature=1.0, seed=4), 1000)) == set(range(VOCAB))


def test_seeds_reproduce_and_differ():
    first = [int(sampler(seed=11).draw(mx.array(LOGITS)).item())]
    a, b, c = sampler(seed=11), sampler(seed=11), sampler(seed=12)
    row = mx.array(LOGITS)
    seq_a = [int(a.draw(row).item()) for _ in range(30)]
    seq_b = [int(b.draw(row).item()) for _ in range(30)]
    seq_c = [int(c.draw(row).item()) for _ in range(30)]
    assert seq_a == seq_b and seq_a[:1] == first
    assert seq_a != seq_c


def test_sample_rows_reports_logprobs_per_row():
    rows = mx.array([LOGITS, list(reversed(LOGITS))])
    plain = sampler(temperature=0)
    with_logprobs = sampler(temperature=0, logprobs=True, top_logprobs=3)
    results = sample_rows([plain, with_logprobs], rows)
    assert results[0].token == 0 and results[0].logprob is None
    second = results[1]
    expected = (mx.array(list(reversed(LOGITS))) - mx.logsumexp(rows[1])).tolist()
    assert second.token == VOCAB - 1
    assert second.logprob == pytest.approx(expected[VOCAB - 1], abs=1e-5)
    assert [t for t, _ in second.top_logprobs] == [5, 4, 3]
    assert [lp for _, lp in second.top_logprobs] == pytest.approx(
        [expected[5], expected[4], expected[3]], abs=1e-5)
    assert sum(math.exp(lp) for lp in expected) == pytest.approx(1.0, abs=1e-5)


def test_all_greedy_rows_take_one_batched_argmax():
    rows = mx.array([LOGITS, list(reversed(LOGITS))])
    results = sample_rows([sampler(temperature=0), sampler(temperature=0)], rows)
    assert [r.token for r in results] == [0, VOCAB - 1]


def test_greedy_rows_with_a_logit_bias_take_one_batched_graph(monkeypatch):
    """Greedy rows whose only processing is a logit bias (an EOS ban on every stream) are one
    argmax over the batch, with no per-row graph, and pick what the per-row path picks."""
    rows = mx.array([LOGITS, list(reversed(LOGITS)), LOGITS, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    samplers = [sampler(temperature=0, logit_bias={0: -100.0}),
                sampler(temperature=0),
                sampler(temperature=0, logit_bias={4: 10.0, 1: -5.0}),
                sampler(temperature=0, logit_bias={2: 0.5})]
    per_row = [int(s.draw(s.process(rows[i])).item()) for i, s in enumerate(samplers)]
    assert per_row == [1, VOCAB - 1, 4, 2]

    def no_row_graph(self, logits):
        raise AssertionError("a per-row graph for a batched greedy row")

    monkeypatch.setattr(SequenceSampler, "process", no_row_graph)
    monkeypatch.setattr(SequenceSampler, "draw", no_row_graph)
    assert [r.token for r in sample_rows(samplers, rows)] == per_row


def test_a_row_with_logprobs_or_penalties_keeps_the_per_row_path():
    rows = mx.array([LOGITS, LOGITS])
    biased = sampler(temperature=0, logit_bias={0: -100.0})
    results = sample_rows([biased, sampler(temperature=0, logprobs=True)], rows)
    assert [r.token for r in results] == [1, 0] and results[1].logprob is not None
    penalised = SequenceSampler(SamplingParams(temperature=0, repetition_penalty=10.0),
                                prompt_tokens=[0], vocab_size=VOCAB)
    assert [r.token for r in sample_rows([biased, penalised], rows)] == [1, 1]


def test_bad_values_are_rejected():
    with pytest.raises(InvalidRequestError):
        sampler(logit_bias={VOCAB: 1.0})
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(top_logprobs=21),
                dict(stop=[""]), dict(min_p=1.5)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad).validate()
