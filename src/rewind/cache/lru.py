"""A byte-budgeted LRU over chained entries that evicts only leaves.

Each entry names its parent (the record of the previous block) or None. A restore at block `b`
needs the whole chain up to `b`, so evicting an entry that a present entry names as parent would
leave a hole that makes everything after it useless while still costing bytes. Eviction
therefore takes the least recently used *leaf* (no present entry names it as parent); a chain
shrinks from its tail. A parent may be absent (it lives in another tier, or was never stored):
the entry is then the head of its chain here.

Not thread-safe: each tier calls it under its own lock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

Key = Hashable
EvictCallback = Callable[[Key, "Key | None", int], None]  # key, parent, nbytes


@dataclass
class _Entry:
    parent: Key | None
    nbytes: int
    stamp: int  # last use; larger is more recent


class ChainLRU:
    """key -> (parent, nbytes) under `budget_bytes`, evicting least-recently-used leaves."""

    def __init__(self, budget_bytes: int, on_evict: EvictCallback | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self.total_bytes = 0
        self.evictions = 0
        self._entries: dict[Key, _Entry] = {}
        # Children by parent key, also for parents that are absent: a parent that arrives
        # after its child (spilled from RAM in leaf-first order) must not count as a leaf.
        self._children: dict[Key, set[Key]] = {}
        self._clock = 0
        # Lazy min-heap of (stamp, seq, key) for leaves; stale rows (entry gone, re-stamped,
        # or no longer a leaf) are skipped when popped and purged when they pile up.
        self._leaf_heap: list[tuple[int, int, Key]] = []
        self._seq = 0

    # ---- queries -----------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self, key: Key) -> int:
        return self._entries[key].nbytes

    def parent(self, key: Key) -> Key | None:
        return self._entries[key].parent

    def is_leaf(self, key: Key) -> bool:
        return not any(child in self._entries for child in self._children.get(key, ()))

    def keys_by_recency(self) -> list[Key]:
        """Oldest first (for tests and debugging; O(n log n))."""
        return sorted(self._entries, key=lambda k: self._entries[k].stamp)

    def chain_bytes(self, key: Key) -> int:
        """Bytes of `key` and of its present ancestors."""
        total = 0
        seen: set[Key] = set()
        current: Key | None = key
        while current is not None and current in self._entries and current not in seen:
            seen.add(current)
            entry = self._entries[current]
            total += entry.nbytes
            current = entry.parent
        return total

    def descendants(self, key: Key) -> list[Key]:
        """Present entries below `key` (children first, then theirs), `key` excluded."""
        found: list[Key] = []
        frontier = [key]
        seen = {key}
        while frontier:
            node = frontier.pop()
            for child in self._children.get(node, ()):
                if child in self._entries and child not in seen:
                    seen.add(child)
                    found.append(child)
                    frontier.append(child)
        return found

    # ---- updates -----------------------------------------------------------------------
    def add(self, key: Key, parent: Key | None, nbytes: int) -> bool:
        """Admit an entry as most recently used, evicting leaves to stay under budget.

        Returns False (and changes nothing) when the entry cannot fit even after every entry
        outside its own chain is gone. An existing key is only touched.
        """
        if key in self._entries:
            self.touch(key)
            return True
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if parent == key:
            parent = None  # its own parent would make it a permanent non-leaf
        ancestors = self.chain_bytes(parent) if parent is not None else 0
        if ancestors + nbytes > self.budget_bytes:
            return False
        self._entries[key] = _Entry(parent, nbytes, self._tick())
        self.total_bytes += nbytes
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        if self.is_leaf(key):
            self._push_leaf(key)
        self._evict_until_within(protect=key)
        return True

    def touch(self, key: Key) -> None:
        """Mark use; a restore touches its whole chain, head first, so the tail stays newest."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.stamp = self._tick()
        if self.is_leaf(key):
            self._push_leaf(key)

    def touch_chain(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: Key) -> int:
        """Drop one entry (no callback); returns its bytes, 0 if absent.

        Removing an inner entry leaves its descendants as heads of their own chains: callers
        that want no holes use remove_subtree.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self.total_bytes -= entry.nbytes
        self._unlink(key, entry)
        return entry.nbytes

    def remove_subtree(self, key: Key) -> list[Key]:
        """Drop `key` and every present descendant (no callbacks); returns what was dropped."""
        doomed = [key] if key in self._entries else []
        doomed += self.descendants(key)
        for node in reversed(doomed):  # leaves first, so each removal keeps the tree consistent
            self.remove(node)
        return doomed

    def evict_one(self, protect: Key | None = None) -> Key | None:
        """Evict the least recently used leaf other than `protect` and its ancestors."""
        skipped: list[tuple[int, int, Key]] = []
        victim: Key | None = None
        protected = self._ancestry(protect) if protect is not None else set()
        while self._leaf_heap:
            row = heapq.heappop(self._leaf_heap)
            stamp, _, key = row
            entry = self._entries.get(key)
            if entry is None or entry.stamp != stamp or not self.is_leaf(key):
                continue  # stale row
            if key in protected:
                skipped.append(row)
                continue
            victim = key
            break
        for row in skipped:
            heapq.heappush(self._leaf_heap, row)
        if victim is None:
            return None
        parent = self._entries[victim].parent
        nbytes = self.remove(victim)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(victim, parent, nbytes)
        return victim

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._evict_until_within(protect=None)

    # ---- internals ---------------------------------------------------------------------
    def _evict_until_within(self, protect: Key | None) -> None:
        while self.total_bytes > self.budget_bytes:
            if self.evict_one(protect=protect) is None:
                break

    def _ancestry(self, key: Key) -> set[Key]:
        found: set[Key] = set()
        current: Key | None = key
        while current is not None and current in self._entries and current not in found:
            found.add(current)
            current = self._entries[current].parent
        return found

    def _unlink(self, key: Key, entry: _Entry) -> None:
        parent = entry.parent
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
            if parent in self._entries and self.is_leaf(parent):
                self._push_leaf(parent)  # the parent just became a leaf

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push_leaf(self, key: Key) -> None:
        self._seq += 1
        heapq.heappush(self._leaf_heap, (self._entries[key].stamp, self._seq, key))
        if len(self._leaf_heap) > 4 * len(self._entries) + 64:
            self._leaf_heap = [
                (entry.stamp, i, k)
                for i, (k, entry) in enumerate(self._entries.items())
                if self.is_leaf(k)
            ]
            heapq.heapify(self._leaf_heap)
