"""Draft sources (prompt lookup, the pool of recent answers) and the cache rollback a
speculative step relies on, through their public functions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from rewind.cache.kv import GrowingKVCache
from rewind.cache.rollback import roll_back, rolls_back
from rewind.engine.drafts import DraftPool, NgramIndex


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    index = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # "2 3" occurred twice before the end; "1 2 3" once, followed by 4 5: the longer wins.
    assert index.continuation(index.tokens, 3) == [4, 5, 9]
    index.extend([7])  # now "... 2 3 7": "3 7" was followed by 8
    assert index.continuation(index.tokens, 2) == [8, 1]
    assert index.continuation([42, 43], 4) == []  # never seen
    assert index.continuation(index.tokens, 0) == []


def test_the_context_never_matches_itself():
    index = NgramIndex([5, 6, 7])
    assert index.continuation(index.tokens, 4) == []  # only occurrence is the suffix itself


def test_the_pool_keeps_tenants_apart_and_drops_the_oldest_answers():
    pool = DraftPool(max_tokens=10)
    pool.add("a", [1, 2, 3, 4, 5, 6])
    assert pool.continuation("a", [9, 2, 3], 3) == [4, 5, 6]
    assert pool.continuation("b", [9, 2, 3], 3) == []  # another tenant's answers are not its
    pool.add("b", [20, 21, 22, 23, 24, 25])  # 12 tokens held > 10: a's answer goes
    assert pool.continuation("a", [9, 2, 3], 3) == []
    assert pool.continuation("b", [21, 22], 2) == [23, 24]


def _filled(cache, tokens: int, start: int = 0, step: int = 1):
    """Feed `tokens` positions (key/value = their position) in calls of `step` tokens."""
    for first in range(start, start + tokens, step):
        n = min(step, start + tokens - first)
        rows = mx.arange(first, first + n, dtype=mx.float32).reshape(1, 1, n, 1)
        cache.update_and_fetch(rows, rows)
    return cache


def _in_order(cache) -> list[int]:
    keys = cache._temporal_order(cache.keys) if isinstance(cache, RotatingKVCache) else cache.keys
    keys = keys[..., : cache.offset, :] if not isinstance(cache, RotatingKVCache) else keys
    return [int(v) for v in keys.reshape(-1).tolist()]


@pytest.mark.parametrize("held", [20, 40, 100])  # within the window, just past, far past
def test_a_sliding_window_gives_back_a_calls_last_tokens(held):
    """After a 6-token call and a rollback of 4, the window holds what a 2-token call would
    have left, and the next one-token step writes where it would have."""
    window = 32
    rolled = _filled(RotatingKVCache(window), held, step=1)
    _filled(rolled, 6, start=held, step=6)
    roll_back([rolled], 4)
    plain = _filled(RotatingKVCache(window), held, step=1)
    _filled(plain, 2, start=held, step=2)
    assert rolled.offset == plain.offset == held + 2
    assert _in_order(rolled)[-window:] == _in_order(plain)[-window:]
    for cache in (rolled, plain):
        _filled(cache, 3, start=held + 2, step=1)
    assert _in_order(rolled)[-window:] == _in_order(plain)[-window:]


def test_full_attention_gives_back_and_linear_attention_refuses():
    cache = _filled(GrowingKVCache(), 10, step=5)
    roll_back([cache], 3)
    assert cache.offset == 7 and _in_order(cache) == list(range(7))
    state = ArraysCache(2)
    assert not rolls_back([cache, state])
    with pytest.raises(ValueError, match="cannot give tokens back"):
        roll_back([cache, state], 1)
    assert cache.offset == 7  # refused before any layer changed
    with pytest.raises(ValueError, match="cannot give back"):
        roll_back([cache], 8)


def test_a_prompt_indexed_at_once_drafts_as_one_indexed_token_by_token():
    """A prompt is indexed in vectorized passes, generated tokens one by one: both find the
    same latest occurrences."""
    import random

    rng = random.Random(3)
    tokens = [rng.randrange(40) for _ in range(3000)]  # a small alphabet: many repeats
    whole = NgramIndex(tokens)
    grown = NgramIndex()
    for token in tokens:
        grown.extend([token])
        grown.continuation(grown.tokens, 1)  # indexes what is there so far
    for end in range(100, 3000, 97):
        context = tokens[:end]
        assert NgramIndex(context).continuation(context, 5) == \
            _slow_continuation(context, 5)
    assert whole.continuation(tokens, 8) == grown.continuation(tokens, 8) == \
        _slow_continuation(tokens, 8)


def _slow_continuation(tokens: list[int], limit: int) -> list[int]:
    """The definition: the longest suffix (6, 4, 3, 2) with an earlier occurrence, latest one."""
    for n in (6, 4, 3, 2):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + limit]
    return []


def test_a_row_feeds_only_as_much_of_its_draft_as_raises_the_steps_rate():
    """A row the model mostly agrees with drafts long alone and still drafts beside two other
    rows; one it agrees with about half the time drafts a few tokens alone and at most one
    beside others, a little less and none (the whole batch would wait for positions it is not
    expected to keep) until its evidence fades; one it agrees with a fifth of the time does not
    draft."""
    from rewind.engine.speculation import VNNI_COSTS, RowDrafts, Speculator

    def row(agreed: float, disagreed: float) -> RowDrafts:
        return RowDrafts(NgramIndex([1, 2, 3]), agreed=agreed, disagreed=disagreed)

    agreeing, middling, wavering, doubtful = row(90, 10), row(3, 5), row(2, 6), row(1, 20)
    alone, three = (1.0, 1, 1), (3.0, 3, 3)  # (expected tokens, positions, rows)
    assert Speculator.worth_drafting(agreeing, 16, *alone)[0] >= 8
    assert Speculator.worth_drafting(agreeing, 16, *three)[0] >= 4
    assert 0 < Speculator.worth_drafting(middling, 16, *alone)[0] <= 4
    assert Speculator.worth_drafting(middling, 16, *three)[0] <= 1
    assert Speculator.worth_drafting(wavering, 16, *three)[0] == 0
    assert Speculator.worth_drafting(doubtful, 16, *alone)[0] == 0
    # Held back, a row's evidence fades toward the prior until it drafts again.
    held_back = 1
    while not Speculator.worth_drafting(wavering, 16, *three)[0]:
        held_back += 1
    assert 1 <= held_back <= 40
    # Never more than was found, and a step's rate only grows.
    length, tokens, positions = Speculator.worth_drafting(agreeing, 3, *three)
    assert 0 < length <= 3 and positions == 3 + length
    assert tokens / VNNI_COSTS.cost(positions, 3) > three[0] / VNNI_COSTS.cost(3, 3)


@pytest.mark.parametrize("kernels", ["avx512vnni", "avx2"])
def test_a_steps_cost_follows_the_measured_points_and_widens_by_the_last_span(kernels: str):
    """The step cost by positions: the measured points themselves, between them on the line,
    past them at the last span's rate."""
    from rewind.engine.speculation import step_costs_for

    costs = step_costs_for(kernels)
    for positions, cost in costs.points:
        assert costs.cost(positions, 1) == pytest.approx(cost)
    (x0, y0), (x1, y1) = costs.points[-2:]
    assert costs.cost(x1 + 8, 1) == pytest.approx(y1 + 8 * (y1 - y0) / (x1 - x0))
    (_, at3), (_, at5) = costs.points[2:4]
    assert costs.cost(4, 3) == pytest.approx((at3 + at5) / 2 + 2 * costs.row_cost)
    # Every position costs something, and a row beside others costs its own share.
    assert all(costs.cost(n + 1, 1) > costs.cost(n, 1) for n in range(1, 30))
    assert costs.cost(3, 3) > costs.cost(3, 1)


def test_auto_prices_drafts_by_the_kernels_own_costs():
    """Where a drafted position costs more (the AVX2 build, no int8 dot-product instruction), a
    row drafts less: the same row feeds a shorter draft, alone and beside others; a build
    without measured figures takes the VNNI build's."""
    from rewind.engine.speculation import (AVX2_COSTS, VNNI_COSTS, RowDrafts, Speculator,
                                           step_costs_for)

    assert step_costs_for(None) is VNNI_COSTS and step_costs_for("avx2") is AVX2_COSTS
    for step in ((1.0, 1, 1), (3.0, 3, 3)):
        cheap, dear = (Speculator.worth_drafting(RowDrafts(NgramIndex([1, 2, 3]), agreed=20,
                                                           disagreed=4), 16, *step, costs)[0]
                       for costs in (VNNI_COSTS, AVX2_COSTS))
        assert dear < cheap, step
    assert Speculator("ngram", costs=AVX2_COSTS).costs is AVX2_COSTS


def test_a_new_row_starts_from_the_engines_recent_acceptance():
    """An agent's answers are short: a row begins where the rows before it left the estimate,
    not at the first prior."""
    from rewind.engine.speculation import FIRST_PRIOR, Speculator

    speculator = Speculator("ngram")
    assert speculator.start([1, 2, 3]).acceptance == pytest.approx(FIRST_PRIOR)
    for _ in range(30):
        speculator.record(speculator.start([1, 2, 3]), 0, drafted=4, accepted=0)
    assert speculator.start([1, 2, 3]).acceptance < 0.3
    for _ in range(60):
        speculator.record(speculator.start([1, 2, 3]), 0, drafted=4, accepted=4)
    assert speculator.start([1, 2, 3]).acceptance > 0.9


def test_auto_trims_a_failing_rows_long_draft_where_an_explicit_mode_feeds_it_all():
    """Beside two other rows, a row whose last drafts failed feeds a token or two of a
    16-token draft under `auto`, all 16 under a mode named explicitly."""
    from rewind.engine.speculation import RowDrafts, Speculator

    failing = RowDrafts(NgramIndex([1, 2, 3]), agreed=0, disagreed=2)
    auto, explicit = Speculator("suffix"), Speculator("suffix", weighs_cost=False)
    assert 0 < auto.feed(failing, 16, 3.0, 3, 3)[0] <= 2
    assert explicit.feed(failing, 16, 3.0, 3, 3) == (16, 3.0 + failing.expected_kept(16), 19)
