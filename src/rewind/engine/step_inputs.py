"""A plan's forward pass as the runner's segments: the model's inputs of each decode row and
prompt call, read from the sequences the plan names."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from rewind.engine.segment import RowCaches, Segment
from rewind.engine.sequence import Sequence
from rewind.engine.step_plan import PrefillSlice, StepPlan


def decode_segments(plan: StepPlan, takes_positions: bool) -> list[Segment]:
    """The decode rows' segments: every row as one (RowCaches: a call per row in one pass),
    or, with drafts, each drafting row as its own call over [input, draft] with logits at
    every position, then the other rows together."""
    rows, batch = plan.decode, plan.batch or []
    if not rows:
        return []
    if plan.pipelined:
        inputs = (mx.array([[s.next_input] for s in rows]) if plan.fed is None
                  else plan.fed.tokens.reshape(-1, 1))
        return [Segment(inputs, batch, logits=True)]
    if not plan.drafts:
        return [Segment(tokens=mx.array([[s.next_input] for s in rows]), cache=batch,
                        logits=True, positions=_decode_positions(rows) if takes_positions
                        else None)]
    segments = [Segment(tokens=mx.array([[rows[row].next_input, *draft]]), cache=batch[row],
                        logits=True, logit_positions=len(draft) + 1)
                for row, draft in plan.drafts]
    plain = plain_rows(plan)
    if plain:
        segments.append(Segment(tokens=mx.array([[rows[r].next_input] for r in plain]),
                                cache=RowCaches([batch[r] for r in plain]), logits=True))
    return segments


def plain_rows(plan: StepPlan) -> list[int]:
    """The decode rows that do not draft this pass."""
    drafting = {row for row, _ in plan.drafts}
    return [r for r in range(len(plan.decode)) if r not in drafting]


def _decode_positions(rows: list[Sequence]) -> mx.array:
    """[3, rows, 1] rotary positions of a decode step's inputs on a model that takes positions
    (rewind.engine.positions): each row's input is token index `held` of its sequence, at
    position held + the request's position_delta."""
    positions = [s.held + s.request.position_delta for s in rows]
    return mx.broadcast_to(mx.array(positions, dtype=mx.int32)[None, :, None],
                           (3, len(positions), 1))


def prefill_segment(call: PrefillSlice[Sequence]) -> Segment:
    """One prompt call on its sequence's own cache."""
    seq, start, end = call.prompt, call.start, call.end
    request = seq.request
    cache: list[Any] = seq.cache or []
    logits = end == seq.prompt_length
    if seq.partial is not None:  # its rows are in flight: no new inputs
        return Segment(tokens=mx.array([[0]]), cache=cache, logits=logits, stop=call.stop,
                       carry=seq.partial)
    # The ids the model is given: the prompt's, or the image prompt's model_tokens where its
    # model reads more than embeddings from them (Gemma 4's per-layer inputs: image tokens as
    # 0). Cache keys and checkpoints keep seq.prompt.
    ids = seq.prompt if request.model_tokens is None else request.model_tokens
    return Segment(
        tokens=mx.array([ids[start:end]]),
        cache=cache,
        logits=logits,
        # Image prompts: this call's input embeddings (image features in image spans).
        embeds=None if request.embed is None else request.embed(start, end),
        # Qwen-VL image prompts: their 3-D rotary positions (rewind.engine.positions);
        # Qwen3-VL's: the features added after its first layers (engine.residuals).
        positions=None if request.positions is None else request.positions(start, end),
        residuals=(None if request.layer_residuals is None
                   else request.layer_residuals(start, end)),
        stop=call.stop,
    )
