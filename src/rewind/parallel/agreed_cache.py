"""A prompt cache per rank that restores only at a point every rank holds.

Each rank keeps the records of its own shard (its heads under tensor parallelism, its layers
under pipeline parallelism) in a cache of its own. Their contents can differ: eviction goes by
bytes, and a pipeline stage's layers weigh more or less than another's; a disk fault hits one
rank. Restoring different lengths would make the ranks prefill different chunks, and the
collectives inside the forward would then pair up wrong calls. So every rank restores, all
report how many tokens they got, and while they differ each restores again below the smallest
(restore leaves at least one token to compute, so restoring `tokens[:n + 1]` gives the longest
point at or below n). The loop ends, at 0 at worst, on every rank at once.

The scheduler calls restore on every rank at the same moment of the same step (admission is
replayed identically), so the collectives here pair up; nothing between them may raise.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from rewind.parallel.group import gather_ints

log = logging.getLogger(__name__)


class RankAgreedCache:
    """Wraps a PromptCache; `restore` agrees with the other ranks, the rest is the wrapped one's."""

    def __init__(self, inner: Any, group: mx.distributed.Group) -> None:
        self.inner = inner
        self.group = group
        self.rounds = 0  # restores that needed more than one round (ranks disagreed)

    def restore(self, tokens: list[int], extras: Any = None, max_kv_size: int | None = None) -> Any:
        limit = len(tokens)
        first = True
        while True:
            restored = self._try_restore(tokens[:limit], extras, max_kv_size)
            held = restored.tokens if restored is not None else 0
            points = gather_ints(self.group, held)
            if min(points) == max(points):
                return restored
            if first:
                self.rounds += 1
                first = False
            limit = min(points) + 1

    def _try_restore(self, tokens: list[int], extras: Any, max_kv_size: int | None) -> Any:
        try:
            return self.inner.restore(tokens, extras, max_kv_size=max_kv_size)
        except Exception:  # counts as nothing restored: the other ranks follow down to 0
            log.exception("prompt-cache restore failed on rank %d", self.group.rank())
            return None

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "rank": self.group.rank(), "ranks": self.group.size(),
                "disagreed_restores": self.rounds}

    def __getattr__(self, name: str) -> Any:  # checkpoint, flush, close, block_tokens, ...
        return getattr(self.inner, name)
