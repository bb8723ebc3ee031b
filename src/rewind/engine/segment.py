"""A forward pass's unit of work, as the runner takes it: a block of tokens on its own cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class Segment:
    """One block of a step: tokens [B, L] into `cache` (per-layer caches; B rows of a batch cache
    for the decode batch)."""

    tokens: mx.array
    cache: list[Any]
    logits: bool = False  # return the last position's logits [B, vocab]
    embeds: mx.array | None = None  # input embeddings [B, L, H] (image prompts)
    positions: mx.array | None = None  # explicit rotary positions [3, B, L] (Qwen-VL)
    residuals: Any = None  # per-layer residual inputs (Qwen3-VL's deepstack features)
    # Layer slicing (runners whose `layer_count` is not None): run only the layers before
    # `stop`; the rows still in flight are left in `carry`, which a later call continues from
    # (its `tokens` then unused). After a call `carry` is None once the segment passed them all.
    stop: int | None = None
    carry: Any = None
    # With `logits`: how many last positions' logits, [B, n, vocab] when more than 1 (a
    # speculative step's verification reads the model's choice after every drafted token).
    logit_positions: int = 1

    @property
    def plain(self) -> bool:
        """No per-call model state: can share a forward pass with other segments."""
        return self.positions is None and self.residuals is None


class RowCaches(list):
    """A decode batch as its rows' own batch-1 caches (one per-layer list each), for a backend
    whose forward pass shares weights across segments (the CPU kernels): each row then decodes
    as its own segment, computed as it would be alone."""
