"""Where draft tokens come from: n-gram lookup in a sequence's own context, and in a pool of the
recent answers of the same model.

Agents re-send text the conversation already holds (a file written back with one line changed,
a diff's context, a path quoted again), so the tokens that follow the last few generated ones
have often followed the same few tokens before. Prompt lookup (vLLM's `ngram`, llama.cpp's
lookup decoding) finds the latest earlier place the context's last n tokens occurred and drafts
what came after it there, longest n first. The pool does the same over the answers other
requests of this engine finished recently (llama.cpp's ngram-mod pool, shared by all slots), so
a session's next turn drafts from what an earlier turn wrote even where the client cut that
answer out of the conversation. Each tenant (cache salt) has its own pool: drafts never carry
one tenant's text into another's timing.

Both are hash maps from an n-gram's 64-bit hash to the position after its latest occurrence:
O(1) a lookup, O(len(NGRAM_SIZES)) an appended token, a prompt indexed in vectorized passes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# n-gram lengths tried, longest first: a longer match is a more specific context, so its
# continuation is likelier to be what the model writes next.
NGRAM_SIZES = (6, 4, 3, 2)


_PRIME = 1_000_003  # the n-gram hash's base
_MASK = (1 << 64) - 1


def _ngram_hash(tokens: Sequence[int]) -> int:
    """The hash `_hashes` computes for one n-gram, in Python integers (64-bit wrap-around). A
    collision only drafts tokens the model then rejects: drafts never change an answer."""
    value = 0
    for token in tokens:
        value = (value * _PRIME + int(token)) & _MASK
    return (value + len(tokens) * 0x9E3779B97F4A7C15) & _MASK


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """The hash of every n-gram of `tokens` (uint64, wrapping), vectorized: a 10k-token prompt
    is indexed in milliseconds where a dict of tuples took ~60 ms of the engine thread."""
    count = len(tokens) - n + 1
    value = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            value = value * np.uint64(_PRIME) + tokens[i:i + count].astype(np.uint64)
        return value + np.uint64((n * 0x9E3779B97F4A7C15) & _MASK)


class NgramIndex:
    """A growing token sequence and, for each n in NGRAM_SIZES, where each n-gram last ended
    (by its 64-bit hash)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = list(tokens)
        self._after: dict[int, int] = {}  # n-gram hash -> index after its last occurrence
        self._indexed = 0  # n-grams ending before this index are in `_after`

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def _index(self) -> None:
        """Index every n-gram that has a continuation: those ending before the last token (the
        context's own suffix must not match itself). Ends in order, so a later occurrence
        overwrites an earlier one."""
        first, last = max(self._indexed, 1), len(self.tokens) - 1  # ends first..last
        if last < first:
            return
        after = self._after
        if last - first > 64:
            # Vectorized (a prompt): for each n, every end in [first, last] at once.
            lowest = max(0, first - max(NGRAM_SIZES))
            window = np.asarray(self.tokens[lowest:last], dtype=np.int64)
            updates: list[tuple[np.ndarray, np.ndarray]] = []
            for n in NGRAM_SIZES:
                start = max(first, n)  # the first end with n tokens before it
                if start > last:
                    continue
                values = _hashes(window[start - n - lowest:last - lowest], n)
                updates.append((np.arange(start, last + 1), values))
            # Apply in order of end position, whatever n, so the latest occurrence wins.
            ends = np.concatenate([e for e, _ in updates]) if updates else np.empty(0, int)
            values = np.concatenate([v for _, v in updates]) if updates else np.empty(0)
            order = np.argsort(ends, kind="stable")
            after.update(zip(values[order].tolist(), ends[order].tolist()))
        else:
            tokens = self.tokens
            for end in range(first, last + 1):
                for n in NGRAM_SIZES:
                    if end >= n:
                        after[_ngram_hash(tokens[end - n:end])] = end
        self._indexed = last + 1

    def continuation(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        suffix of `context` found here ([] when none is)."""
        if limit <= 0:
            return []
        self._index()
        for n in NGRAM_SIZES:
            if len(context) < n:
                continue
            end = self._after.get(_ngram_hash(context[-n:]))
            if end is not None:
                return self.tokens[end:end + limit]
        return []


class DraftPool:
    """Recent answers of one engine's model, per tenant, bounded in tokens (oldest out first)."""

    def __init__(self, max_tokens: int = 65536) -> None:
        self.max_tokens = max_tokens
        self._answers: OrderedDict[str, list[tuple[int, ...]]] = OrderedDict()
        self._indexes: dict[str, NgramIndex] = {}
        self._held = 0

    def add(self, tenant: str, answer: Sequence[int]) -> None:
        """Remember a finished answer. The tenant's index is rebuilt lazily from what is left
        when old answers go (an answer is short next to the bound, so this is rare)."""
        if len(answer) < 2:
            return
        answer = tuple(answer[-self.max_tokens:])
        self._answers.setdefault(tenant, []).append(answer)
        self._answers.move_to_end(tenant)
        self._held += len(answer)
        evicted = set()
        while self._held > self.max_tokens:
            oldest = next(iter(self._answers))
            answers = self._answers[oldest]
            self._held -= len(answers.pop(0))
            evicted.add(oldest)
            if not answers:
                del self._answers[oldest]
        for name in evicted:
            self._indexes.pop(name, None)
        index = self._indexes.get(tenant)
        if index is not None and tenant not in evicted:
            # Answers are joined end to end; a match across two answers drafts tokens the model
            # rejects at worst.
            index.extend(answer)

    def continuation(self, tenant: str, context: Sequence[int], limit: int) -> list[int]:
        if tenant not in self._answers:
            return []
        index = self._indexes.get(tenant)
        if index is None:
            index = NgramIndex([t for answer in self._answers[tenant] for t in answer])
            self._indexes[tenant] = index
        return index.continuation(context, limit)
