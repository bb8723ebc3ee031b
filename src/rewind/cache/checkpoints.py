"""Where a prompt is cut into model calls, and which of those cuts the prompt cache checkpoints.

One rule for every path that prefills: the server's scheduler, the commands (generate, chat,
cache-prompt), rewind.engine.single's helpers and the benchmarks. Keeping it in one place keeps
the paths in step, which matters twice over: a call's shape changes the summation order of some
families (sliding windows, linear attention), so the same prompt must be cut the same way
whether it is restored, batched or alone; and a checkpoint one path writes is only found by
another if both put it at the same position.

The block size is the prompt cache's (`CacheConfig.block_tokens`, 256 unless configured):
checkpoints fall on its multiples, and the call grid (`chunk_tokens`) divides it so that they
are call ends. Where no prompt cache is in play the default applies.

Checkpoints of a prompt (`is_checkpoint`), at a call end `end` before the prompt's end `total`:
  - every multiple of the block size (the prompt cache's full blocks);
  - every message boundary the caller names (where the next request diverges);
  - total - 1, not total: a restore always leaves the last token to compute (its logits are
    needed), so a point at total - 1 serves both an exact repeat of this prompt and the next
    turn, which extends it.
The prompt's own end is no checkpoint: the decode loop checkpoints what follows it
(`decode_checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from rewind.config import BLOCK_TOKENS, default_chunk_tokens

__all__ = ["BLOCK_TOKENS", "ChunkEnd", "block_tokens_of", "check_chunk_tokens", "chunk_ends",
           "decode_checkpoint", "engine_chunk_tokens", "is_checkpoint", "prefill_plan"]


def block_tokens_of(prompt_cache: Any) -> int:
    """The block size checkpoints follow: the prompt cache's (its config's block_tokens), or the
    default where there is none."""
    return getattr(prompt_cache, "block_tokens", None) or BLOCK_TOKENS


def check_chunk_tokens(chunk_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    if chunk_tokens < 1 or block_tokens % chunk_tokens:
        raise ValueError(f"chunk_tokens={chunk_tokens} must divide the block size {block_tokens}: "
                         "checkpoints sit on block boundaries, which must be chunk ends")
    return chunk_tokens


def engine_chunk_tokens(configured: int | None, block_tokens: int = BLOCK_TOKENS) -> int:
    """The call grid: the configured one (which must divide the block size), or the backend's
    default cut to fit the block size."""
    if configured is not None:
        return check_chunk_tokens(configured, block_tokens)
    return math.gcd(default_chunk_tokens(), block_tokens)


def chunk_ends(start: int, total: int, chunk_tokens: int, stops: Iterable[int] = ()) -> list[int]:
    """Where the model calls covering prompt positions [start, total) end: every multiple of
    `chunk_tokens` (absolute positions, so a restored prefix continues on the same grid), every
    position in `stops` (checkpoints), `total - 1` (the last token goes alone: only its logits
    are needed, and the model computes the output for every position of the call that produces
    them) and `total`."""
    ends = set(range((start // chunk_tokens + 1) * chunk_tokens, total, chunk_tokens))
    ends |= {p for p in stops if start < p < total}
    if total - 1 > start:
        ends.add(total - 1)
    ends.add(total)
    return sorted(ends)


def is_checkpoint(end: int, total: int, block_tokens: int,
                  boundaries: Collection[int] = ()) -> bool:
    """Whether the prompt cache checkpoints a prompt of `total` tokens once the cache holds its
    first `end`: a block boundary, a message boundary, or the prompt's last token but one."""
    return end < total and (end % block_tokens == 0 or end in boundaries or end == total - 1)


def decode_checkpoint(held: int, prompt_tokens: int, block_tokens: int, finished: bool) -> bool:
    """Whether a decoding sequence whose cache holds `held` tokens (its prompt of
    `prompt_tokens`, then generated ones) is checkpointed now: at every block boundary and where
    it ends (the next turn of a conversation usually re-sends this answer), once past the
    prompt (whose points its prefill took)."""
    return (held % block_tokens == 0 or finished) and held > prompt_tokens


@dataclass(frozen=True)
class ChunkEnd:
    """One model call of a prefill: it ends at absolute position `end`; `checkpoint`: the cache
    is handed to the prompt cache (or the caller's hook) after it."""

    end: int
    checkpoint: bool


def prefill_plan(start: int, total: int, chunk_tokens: int, block_tokens: int = BLOCK_TOKENS,
                 boundaries: Iterable[int] = (), *, blocks_only: bool = False) -> list[ChunkEnd]:
    """The calls that feed prompt positions [start, total) into a cache holding `start`, and
    which of their ends are checkpoints (`is_checkpoint`). Message `boundaries` cut calls too,
    so that they are ends.

    `blocks_only`: the checkpoints are the block boundaries alone, the prompt's end included
    where it is one (rewind.engine.single.prefill_prompt's `on_boundary`, which snapshots
    blocks as they complete)."""
    points = set(boundaries)
    ends = chunk_ends(start, total, chunk_tokens, points)
    if blocks_only:
        return [ChunkEnd(end, end % block_tokens == 0) for end in ends]
    return [ChunkEnd(end, is_checkpoint(end, total, block_tokens, points)) for end in ends]
