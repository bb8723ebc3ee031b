"""A draft model: a smaller model of the same vocabulary that drafts each row's next tokens.

Where a row verifies drafts (rewind.engine.speculation: rows decoding alone on the CPU kernels),
the drafts may come from a model instead of the row's own text: mlx-lm's `--draft-model`, inside
the continuous batch. Each drafting row has a cache of the draft model of its own, holding the
row's tokens up to (not including) its next input. To draft k tokens, the row feeds its next
input and then each drafted token but the last, one call each, taking the draft model's greedy
token every time. Whether a draft is kept is the target's verification alone, so the draft
model never changes an answer; only how many tokens a step emits.

After the verification the row's context continues with the accepted drafts: the draft cache
keeps its tokens as far as they agree and gives the rest back, from the snapshot taken before it
drafted (trimmable caches by their offset, sliding windows from copies of their buffers: a ring
that wrapped cannot be trimmed). A row whose draft cache is far behind (its prompt, at first)
catches up at most `catch_up_tokens` a step, and drafts once it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from rewind.cache.rollback import TRIMMED_CACHES
from rewind.engine.vocab import vocab_size

PROBE_TEXT = "Draft models must split text into the same tokens: def f(x): return x * 2\n"


class DraftModelError(ValueError):
    """A draft model that cannot draft for this target."""


@dataclass
class _Snapshot:
    tokens: int  # how many tokens the draft cache held
    # Per layer: ("trim", offset) or ("state", RotatingKVCache.state with copied buffers).
    layers: list[tuple[str, Any]]


@dataclass
class DraftRow:
    """One row's draft-model cache and the tokens in it."""

    cache: list[Any]
    tokens: list[int] = field(default_factory=list)
    snapshot: _Snapshot | None = None


def _copy(array: mx.array | None) -> mx.array | None:
    # A copy in memory of its own: the CPU kernels may write a window's ring in place.
    return None if array is None else mx.array(np.array(array, copy=True))


def check_compatible(target: Any, draft: Any) -> None:
    """Raise DraftModelError unless the two loaded models share a vocabulary: the same number
    of logits and the same tokens for a probe text."""
    sizes = [vocab_size(m.tokenizer, m.config) for m in (target, draft)]
    if sizes[0] != sizes[1]:
        raise DraftModelError(f"the draft model has {sizes[1]} logits, the model {sizes[0]}: "
                              "a draft model must share the model's vocabulary")
    probes = [m.tokenizer.encode(PROBE_TEXT) for m in (target, draft)]
    if probes[0] != probes[1]:
        raise DraftModelError("the draft model's tokenizer splits text differently from the "
                              "model's: a draft model must share the model's tokenizer")


class DraftModel:
    """Drafts for rows, from a loaded model (rewind.models.loader.LoadedModel)."""

    def __init__(self, loaded: Any, catch_up_tokens: int = 256) -> None:
        from rewind.engine.runner import ModelRunner

        self.loaded = loaded
        self.runner = ModelRunner(loaded.model)
        self.catch_up_tokens = catch_up_tokens
        probe = self.runner.new_cache()
        unsupported = {type(c).__name__ for c in probe
                       if not isinstance(c, TRIMMED_CACHES) and type(c) is not RotatingKVCache}
        if unsupported:
            raise DraftModelError(f"a draft model's caches must be attention caches; this one "
                                  f"has {', '.join(sorted(unsupported))}")

    def new_row(self) -> DraftRow:
        return DraftRow(self.runner.new_cache())

    def propose(self, row: DraftRow, context: list[int], limit: int) -> list[int]:
        """Up to `limit` greedy tokens of the draft model after `context` (the row's tokens, its
        next input last); [] while the row's draft cache is still catching up."""
        if limit <= 0 or not context:
            return []
        held = context[:-1]
        self._keep_agreeing(row, held)
        missing = held[len(row.tokens):]
        if len(missing) > self.catch_up_tokens:
            self._feed(row, missing[:self.catch_up_tokens], logits=False)
            return []
        if missing:
            self._feed(row, missing, logits=False)
        row.snapshot = self._snapshot(row)
        draft: list[int] = []
        token = context[-1]
        for _ in range(limit):
            logits = self._feed(row, [token], logits=True)
            token = int(mx.argmax(logits[0, -1] if logits.ndim == 3 else logits[-1]).item())
            draft.append(token)
        return draft

    def _keep_agreeing(self, row: DraftRow, held: list[int]) -> None:
        """Give back the draft cache's tokens past where they agree with `held`."""
        agree = 0
        for mine, theirs in zip(row.tokens, held):
            if mine != theirs:
                break
            agree += 1
        if agree == len(row.tokens):
            return
        snapshot = row.snapshot
        if snapshot is not None and snapshot.tokens <= agree:
            for cache, (how, saved) in zip(row.cache, snapshot.layers):
                if how == "trim":
                    cache.trim(cache.offset - saved)
                else:
                    cache.state = saved
            del row.tokens[snapshot.tokens:]
        else:  # nothing to go back to (not expected): start the row's draft cache again
            row.cache = self.runner.new_cache()
            row.tokens = []
        row.snapshot = None

    def _snapshot(self, row: DraftRow) -> _Snapshot:
        layers: list[tuple[str, Any]] = []
        for cache in row.cache:
            if isinstance(cache, TRIMMED_CACHES):
                layers.append(("trim", cache.offset))
            else:
                keys, values, *meta = cache.state  # keys None while the ring is empty
                layers.append(("state", (_copy(keys), _copy(values), *meta)))
        return _Snapshot(len(row.tokens), layers)

    def _feed(self, row: DraftRow, tokens: list[int], logits: bool) -> mx.array | None:
        out = self.runner.prefill(row.cache, tokens, len(row.tokens), logits=logits)
        row.tokens.extend(tokens)
        if out is not None:
            mx.eval(out)
        return out
