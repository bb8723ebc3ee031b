"""The step planner (rewind.engine.planner) without a model: prompts are plain records and the
cost model a table, so each rule of the budget is checked on its own. The last test watches the
plans a real engine makes through its public step listener."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rewind.engine.planner import passes_every_layer, plan_prefill


@dataclass
class Prompt:
    prompt_length: int
    prefilled: int = 0
    in_flight: tuple[int, int] | None = None
    checkpoint_at: set[int] = field(default_factory=set)
    sliceable: bool = True


@dataclass
class Costs:
    """Per-layer cost of one token: `base` per layer, plus `per_context` per token held."""

    layer_count: int | None = 4
    base: float = 1.0
    per_context: float = 0.0

    def layer_costs(self, context: int) -> list[float]:
        if self.layer_count is None:
            return [1.0]
        return [self.base + self.per_context * context] * self.layer_count


def calls(passes):
    return [[(c.start, c.end, c.stop, c.first) for c in one] for one in passes]


def test_whole_calls_go_round_robin_and_stop_at_the_first_that_does_not_fit():
    a, b = Prompt(300), Prompt(100)
    passes = plan_prefill([a, b], budget_tokens=200, chunk_tokens=64, costs=Costs(),
                          sliced=False, pass_tokens=10)
    # Pass 0: each prompt's first call; pass 1: a's second (64) fits the 72 left, b's does
    # not (64 > 8) and ends the step.
    assert [[p is a for p in [c.prompt for c in one]] for one in passes] == [[True, False], [True]]
    assert calls(passes) == [[(0, 64, None, 0), (0, 64, None, 0)], [(64, 128, None, 0)]]


def test_the_first_call_runs_even_over_the_budget():
    passes = plan_prefill([Prompt(1000)], budget_tokens=1, chunk_tokens=256, costs=Costs(),
                          sliced=False, pass_tokens=10)
    assert calls(passes) == [[(0, 256, None, 0)]]


def test_calls_end_on_the_grid_at_named_boundaries_and_before_the_last_token():
    prompt = Prompt(200, prefilled=70, checkpoint_at={100, 150})
    passes = plan_prefill([prompt], budget_tokens=10_000, chunk_tokens=64, costs=Costs(),
                          sliced=False, pass_tokens=10)
    ends = [one[0].end for one in passes]
    # 128 and 192 on the grid (absolute positions: a restored prefix stays on it), 100 and 150
    # named, 199 so the last token goes alone, then 200.
    assert ends == [100, 128, 150, 192, 199, 200]


def test_a_call_over_the_budget_is_spread_over_layers_and_goes_on_where_it_stopped():
    costs = Costs(layer_count=4)
    prompt = Prompt(1000)
    first = plan_prefill([prompt], budget_tokens=128, chunk_tokens=256, costs=costs,
                         sliced=True, pass_tokens=10)
    # 256 tokens x 4 layers against 128 tokens' worth through every layer: two layers.
    assert calls(first) == [[(0, 256, 2, 0)]]
    assert not passes_every_layer(first[0][0], costs.layer_count)
    prompt.in_flight = (256, 2)
    second = plan_prefill([prompt], budget_tokens=128, chunk_tokens=256, costs=costs,
                          sliced=True, pass_tokens=10)
    assert calls(second) == [[(0, 256, 4, 2)]]
    assert passes_every_layer(second[0][0], costs.layer_count)


def test_a_tiny_budget_still_moves_one_layer_of_one_call():
    passes = plan_prefill([Prompt(1000), Prompt(1000)], budget_tokens=1, chunk_tokens=256,
                          costs=Costs(layer_count=8), sliced=True, pass_tokens=10)
    assert calls(passes) == [[(0, 256, 1, 0)]]


def test_longer_context_costs_more_layers():
    costs = Costs(layer_count=8, per_context=1 / 256)
    early = plan_prefill([Prompt(4000)], 96, 64, costs, sliced=True, pass_tokens=10)
    late = plan_prefill([Prompt(4000, prefilled=3840)], 96, 64, costs, sliced=True,
                        pass_tokens=10)
    assert early[0][0].stop > late[0][0].stop


def test_a_prompts_last_call_goes_alone_in_its_pass():
    ending, other = Prompt(65, prefilled=64), Prompt(1000)
    passes = plan_prefill([ending, other], budget_tokens=10_000, chunk_tokens=64, costs=Costs(),
                          sliced=True, pass_tokens=10)
    assert len(passes) == 1 and [c.prompt for c in passes[0]] == [ending]
    # Behind another call it waits for the next step, so the prompt joining the decode batch
    # is never held by a call planned after it.
    passes = plan_prefill([other, ending], budget_tokens=10_000, chunk_tokens=64, costs=Costs(),
                          sliced=True, pass_tokens=10)
    assert all(c.prompt is not ending for one in passes for c in one)


def test_further_passes_pay_for_reading_the_weights_again():
    costs = Costs(layer_count=2)
    prompt = Prompt(1000, checkpoint_at={20, 30})
    # 20 tokens, then the 10-token call to the named boundary at 30: with pass_tokens=10 the
    # second pass costs 10 + 10 = 20 of the 25 left.
    passes = plan_prefill([prompt], budget_tokens=45, chunk_tokens=64, costs=costs, sliced=True,
                          pass_tokens=10)
    assert calls(passes) == [[(0, 20, 2, 0)], [(20, 30, 2, 0)]]
    charged = plan_prefill([prompt], budget_tokens=45, chunk_tokens=64, costs=costs, sliced=True,
                           pass_tokens=30)
    assert calls(charged) == [[(0, 20, 2, 0)]]


def test_only_calls_that_passed_every_layer_go_on_in_a_further_pass():
    done, stopped = Prompt(1000, checkpoint_at={10}), Prompt(1000)
    passes = plan_prefill([done, stopped], budget_tokens=80, chunk_tokens=256,
                          costs=Costs(layer_count=4), sliced=True, pass_tokens=1)
    assert [c.prompt for c in passes[0]] == [done, stopped]
    assert passes[0][1].stop < 4
    assert all(c.prompt is done for one in passes[1:] for c in one)


def test_a_prompt_that_cannot_stop_between_layers_runs_whole_or_waits():
    pinned = Prompt(1000, sliceable=False)
    passes = plan_prefill([Prompt(1000), pinned], budget_tokens=300, chunk_tokens=256,
                          costs=Costs(layer_count=4), sliced=True, pass_tokens=10)
    assert [c.prompt for c in passes[0]] == [passes[0][0].prompt]
    alone = plan_prefill([pinned], budget_tokens=1, chunk_tokens=256, costs=Costs(layer_count=4),
                         sliced=True, pass_tokens=10)
    assert calls(alone) == [[(0, 256, None, 0)]]


@pytest.mark.parametrize("pipelined", [False, True], ids=["unpipelined", "pipelined"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_an_engines_plans_cover_each_prompt_once_in_order(tiny_loaded, family, pipelined):
    """Through the engine's public step listener: every prompt position is computed by exactly
    one call that passes every layer, in order, and every decode row of a plan is a sequence
    that emits a token in that step. Pipelined (a GPU's decode, forced here on any backend):
    no step is queued for a row whose token in flight is its last by max_tokens."""
    from rewind.config import EngineConfig
    from rewind.engine import Engine, GenerationRequest, SamplingParams

    loaded = tiny_loaded(family)
    prompts = [[5 + (i * 7 + n) % 200 for i in range(n)] for n in (700, 90, 333)]
    plans = []
    config = EngineConfig(parallel=3, mixed_prefill_tokens=48, prefill_chunk=256,
                          pipeline_decode=pipelined)
    with Engine(loaded, config) as engine:
        engine.add_step_listener(lambda plan, timing: plans.append((plan, timing)))
        handles = [engine.submit(GenerationRequest(p, SamplingParams(temperature=0.0,
                                                                     max_tokens=12)))
                   for p in prompts]
        results = [h.collect(60) for h in handles]
    layer_count = engine.runner.layer_count
    for prompt, handle, result in zip(prompts, handles, results):
        request_id = handle.request_id
        covered = [(c.start, c.end) for plan, _ in plans for c in plan.prefill
                   if c.prompt.request.request_id == request_id
                   and passes_every_layer(c, layer_count)]
        assert covered[0][0] == 0 and covered[-1][1] == len(prompt)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        rows = sum(1 for plan, _ in plans for s in plan.decode
                   if s.request.request_id == request_id)
        assert rows == len(result.tokens) - 1  # the first token comes from the prompt's call
    assert all(t.started <= t.planned <= t.ran <= t.ended for _, t in plans)
