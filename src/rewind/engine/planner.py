"""Which prompt calls a step runs: one planner, in cost units, for whole chunks and for layer
slices. Pure: it reads the prompts' positions and a cost model, and returns the calls.

A step runs every decoding row plus prompt calls up to a budget, as vLLM and SGLang schedule.
The budget is in prompt tokens through every layer at no context (`budget_tokens`); a call is
charged what it costs: on a backend whose calls stop between layers (the CPU kernels, `sliced`)
each layer's attention over what the sequence holds counts (`CostModel.layer_costs`), and a
call may stop part-way through the layers; elsewhere a call is its tokens.

The calls come in passes. Pass r holds the r-th call of each prompt that gets one: calls of one
prompt depend on each other, calls of different prompts share a forward pass (each weight read
once for all), so the budget goes round-robin over the prompts, oldest first, and the first
call of a step always runs, so a full decode batch cannot starve a waiting prompt. Each pass
after the first continues only the prompts whose call in the pass before passed every layer.

Where calls are sliced (rows decode beside them), a further pass is charged `pass_tokens` for
reading the weights again, and a prompt's last call goes alone in its pass: its sequence then
joins the decode batch. Whole calls (nothing decodes, or a backend that cannot stop between
layers) stop at the first call that does not fit.

The chunk grid (rewind.cache.checkpoints.chunk_ends) is the same either way, so the answer is.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from rewind.cache.checkpoints import chunk_ends
from rewind.engine.step_plan import PrefillSlice


class PlannedPrompt(Protocol):
    """What the planner reads of a prompt being prefilled (rewind.engine.sequence.Sequence)."""

    @property
    def prompt_length(self) -> int: ...
    @property
    def prefilled(self) -> int: ...  # positions its cache holds
    @property
    def in_flight(self) -> tuple[int, int] | None: ...  # (end, layers passed) of a stopped call
    @property
    def checkpoint_at(self) -> Collection[int]: ...  # extra call ends (message boundaries)
    @property
    def sliceable(self) -> bool: ...  # whether its calls may stop between layers


class CostModel(Protocol):
    """The runner's view of what a call costs (rewind.engine.runner.ModelRunner)."""

    layer_count: int | None

    def layer_costs(self, context: int) -> list[float]: ...


def plan_prefill(prompts: Sequence[PlannedPrompt], budget_tokens: int, chunk_tokens: int,
                 costs: CostModel, sliced: bool,
                 pass_tokens: int) -> list[list[PrefillSlice[PlannedPrompt]]]:
    """This step's prompt calls, pass by pass (see the module's docstring)."""
    layers = (costs.layer_count or 1) if sliced else 1

    def layer_costs(tokens: int, context: int) -> list[float]:
        if not sliced:
            return [float(tokens)]
        return [tokens * cost for cost in costs.layer_costs(context)]

    unit = sum(layer_costs(1, 0))
    left = budget_tokens * unit
    candidates = [(p, p.prefilled, *(p.in_flight or (None, 0))) for p in prompts]
    passes: list[list[PrefillSlice[PlannedPrompt]]] = []
    while candidates and left > 0:
        if passes and sliced:
            left -= pass_tokens * unit
            if left <= 0:
                break
        calls: list[PrefillSlice[PlannedPrompt]] = []
        full = False  # the budget stopped this pass before every candidate had its call
        for prompt, start, end, done in candidates:
            if end is None:
                end = chunk_ends(start, prompt.prompt_length, chunk_tokens,
                                 prompt.checkpoint_at)[0]
            joins = end == prompt.prompt_length
            if sliced and joins and calls:
                full = True
                break
            per_layer = layer_costs(end - start, end)
            if not (sliced and prompt.sliceable):
                # Whole mode counts a call in flight at its full size: it was planned so.
                stop, spent = None, sum(per_layer[done:]) if sliced else per_layer[0]
                if spent > left and (calls or passes):
                    full = True
                    break
            else:
                stop, spent = done, 0.0
                while stop < layers and spent + per_layer[stop] <= left:
                    spent += per_layer[stop]
                    stop += 1
                if stop == done:
                    if calls or passes:
                        full = True
                        break
                    stop, spent = done + 1, per_layer[done]
            calls.append(PrefillSlice(prompt, start, end, stop=stop, first=done))
            left -= spent
            if sliced and (left <= 0 or joins):
                full = True
                break
        if not calls:
            break
        passes.append(calls)
        if full and not sliced:
            break
        candidates = [(c.prompt, c.end, None, 0) for c in calls
                      if c.stop in (None, layers) and c.end < c.prompt.prompt_length]
    return passes


def passes_every_layer(call: PrefillSlice[PlannedPrompt], layer_count: int | None) -> bool:
    """Whether the call's sequence holds its positions once it ran (else its rows wait in
    flight for a later step)."""
    return call.stop is None or layer_count is None or call.stop >= layer_count
