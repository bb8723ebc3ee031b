"""Speculative decoding inside a step: which rows draft, and reading a drafting row's logits back.

The speculator (rewind.engine.speculation) proposes drafts and keeps their record; this decides
how much each decoding row may draft this step, and after the pass emits a drafting row's
tokens up to the first the model disagrees with and rolls its cache back past the rest. The
scheduler owns one (when speculation is on) and keeps the batch: it samples the rows that did
not draft, checkpoints, and lets finished rows leave.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from rewind.cache.rollback import roll_back
from rewind.engine.emission import Emission
from rewind.engine.positions import takes_positions
from rewind.engine.sampler import Sampled, sample_rows
from rewind.engine.segment import RowCaches
from rewind.engine.sequence import Sequence
from rewind.engine.speculation import Speculator, tenant_of

log = logging.getLogger(__name__)

__all__ = ["Verifier"]


class Verifier:
    def __init__(self, speculator: Speculator, emission: Emission, model: Any,
                 block_tokens: int) -> None:
        self.speculator = speculator
        self.emission = emission
        self.model = model
        self.block_tokens = block_tokens

    def drafts(self, decoding: list[Sequence], batch_cache: Any, prefilling: bool,
               steps: int) -> list[tuple[int, list[int]]]:
        """(row, drafted tokens) of the rows that draft this step. None while a prompt is
        being prefilled: a draft lengthens the step that carries the prompt's chunk, and a
        waiting prompt's first token is what an agent's turn waits for (three agent sessions:
        the sum of first-token times rose by a fifth when drafts shared those steps). A draft
        never takes a row's cache past its next block boundary, so its checkpoints fall where
        they would without speculation, nor past its last token (max_tokens); the step's drafts
        stay within `step_tokens`."""
        speculator = self.speculator
        # A model given explicit rotary positions (Qwen-VL image prompts: rewind.vision
        # installs them on the first image, after this scheduler began) decodes with them.
        if (prefilling or takes_positions(self.model)
                or not isinstance(batch_cache, RowCaches)):
            return []
        left = speculator.step_tokens
        out: list[tuple[int, list[int]]] = []
        # The step's draft budget goes round-robin: each step another row asks first.
        rows = len(decoding)
        first = steps % rows if rows else 0
        # The step's expected tokens and the positions it computes, as drafts join it.
        tokens, positions = float(rows), rows
        for row in [*range(first, rows), *range(first)]:
            seq = decoding[row]
            drafts = seq.drafts
            if drafts is None or left <= 0:
                continue
            index = drafts.index
            index.extend(seq.generated[len(index.tokens) - len(seq.prompt):])
            held = len(seq.prompt) + len(seq.generated) - 1
            boundary = (held // self.block_tokens + 1) * self.block_tokens
            limit = min(left, boundary - held - 1,
                        seq.request.params.max_tokens - len(seq.generated) - 1)
            if limit <= 0:
                continue
            draft = speculator.propose(drafts, tenant_of(seq.request.extras), steps, limit)
            length, tokens, positions = speculator.feed(drafts, len(draft), tokens, positions,
                                                        rows)
            if length:
                out.append((row, draft[:length]))
                left -= length
        return sorted(out)

    def verify(self, drafted: list[tuple[int, list[int]]], logits: list[mx.array | None],
               decoding: list[Sequence], batch: list[Any], steps: int) -> set[int]:
        """Emit each drafting row's tokens, position by position, as its sampler draws them
        from the logits after the tokens accepted before, up to the first that differs from
        the draft (that one is the model's own, and emitted too); then roll the row's cache back
        past what it did not keep. The rows whose sequence ended."""
        speculator = self.speculator
        done: set[int] = set()
        speculator.counters.steps += 1
        for (row, draft), row_logits in zip(drafted, logits):
            seq = decoding[row]
            emitted, accepted, alive = self._verify_row(seq, draft, row_logits)
            try:
                roll_back(batch[row], len(draft) + 1 - emitted)
            except Exception as exc:  # the row's cache holds tokens it did not keep
                log.exception("rolling back the draft of %s failed", seq.request.request_id)
                if alive:
                    self.emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")
                alive = False
            if seq.drafts is not None:
                speculator.record(seq.drafts, steps, len(draft), accepted)
            seq.usage.drafted_tokens += len(draft)
            seq.usage.accepted_tokens += accepted
            if not alive:
                done.add(row)
        return done

    def _verify_row(self, seq: Sequence, draft: list[int],
                    logits: mx.array | None) -> tuple[int, int, bool]:
        """Emit a drafting row's tokens from its logits [1, len(draft) + 1, vocab]: (tokens
        emitted, drafted tokens accepted, whether the sequence goes on)."""
        assert logits is not None
        emission = self.emission
        greedy = seq.sampler.plain_greedy
        try:
            choices = mx.argmax(logits[0], axis=-1).tolist() if greedy else []
        except Exception as exc:
            emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return 0, 0, False
        emitted = accepted = 0
        for position in range(len(draft) + 1):
            if greedy:
                sampled = Sampled(int(choices[position]), None, None)
            else:
                try:
                    sampled = sample_rows([seq.sampler], logits[:, position, :])[0]
                except Exception as exc:
                    log.exception("sampling failed for %s", seq.request.request_id)
                    emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")
                    return emitted, accepted, False
            emitted += 1
            if not emission.on_token(seq, sampled):
                return emitted, accepted, False
            if position == len(draft) or sampled.token != draft[position]:
                break
            accepted += 1
        return emitted, accepted, True
