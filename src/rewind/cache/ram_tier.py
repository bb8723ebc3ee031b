"""The RAM hot tier: recent records in memory under a byte budget, chain-aware LRU.

What the LRU evicts is handed to `spill` (the disk tier's put) instead of being lost. Spills
run after the tier's lock is released, because the disk tier may block on its writer queue.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Hashable

from rewind.cache.lru import ChainLRU
from rewind.cache.serialize import Record

Key = Hashable
log = logging.getLogger(__name__)
SpillCallback = Callable[[Key, "Key | None", Record], object]


class RamTier:
    """key -> Record in memory, at most `budget_bytes` of array bytes."""

    def __init__(self, budget_bytes: int, spill: SpillCallback | None = None) -> None:
        self.spill = spill
        self._lock = threading.Lock()
        self._records: dict[Key, Record] = {}
        self._evicted: list[tuple[Key, Key | None, Record]] = []  # to spill once unlocked
        self._lru = ChainLRU(budget_bytes, on_evict=self._on_evict)
        self._hits = 0
        self._misses = 0
        self._rejected = 0
        self._spilled = 0
        self._spill_errors = 0

    @property
    def budget_bytes(self) -> int:
        return self._lru.budget_bytes

    def put(self, key: Key, parent: Key | None, record: Record) -> bool:
        """Keep `record` as most recently used; False if it cannot fit (it is spilled instead).

        The arrays must already be evaluated; the tier holds references, never copies.
        """
        with self._lock:
            if key in self._records:
                self._lru.touch(key)
                return True
            admitted = self._lru.add(key, parent, record.nbytes)
            if admitted:
                self._records[key] = record
            else:
                self._rejected += 1
                self._evicted.append((key, parent, record))
            spills = self._take_evicted()
        self._spill(spills)
        return admitted

    def get(self, key: Key) -> Record | None:
        with self._lock:
            record = self._records.get(key)
            if record is None:
                self._misses += 1
                return None
            self._hits += 1
            self._lru.touch(key)
            return record

    def peek(self, key: Key) -> Record | None:
        """The record without marking use or counting a hit (for planning)."""
        with self._lock:
            return self._records.get(key)

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._records

    def __contains__(self, key: Key) -> bool:
        return self.contains(key)

    def touch(self, key: Key) -> None:
        with self._lock:
            self._lru.touch(key)

    def discard(self, key: Key) -> int:
        """Drop `key` and its descendants here (no spill, a chain keeps no hole); returns count."""
        with self._lock:
            dropped = self._lru.remove_subtree(key)
            for node in dropped:
                self._records.pop(node, None)
            return len(dropped)

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            self._lru.set_budget(budget_bytes)
            spills = self._take_evicted()
        self._spill(spills)

    def clear(self) -> None:
        """Drop everything without spilling (shutdown)."""
        with self._lock:
            for key in list(self._records):
                self._lru.remove(key)
            self._records.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._records),
                "bytes": self._lru.total_bytes,
                "budget_bytes": self._lru.budget_bytes,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._lru.evictions,
                "rejected": self._rejected,
                "spilled": self._spilled,
                "spill_errors": self._spill_errors,
            }

    # ---- internals ---------------------------------------------------------------------
    def _on_evict(self, key: Key, parent: Key | None, nbytes: int) -> None:
        # Called by the LRU under our lock: remember, spill once the lock is released.
        self._evicted.append((key, parent, self._records.pop(key)))

    def _take_evicted(self) -> list[tuple[Key, Key | None, Record]]:
        spills, self._evicted = self._evicted, []
        return spills

    def _spill(self, spills: list[tuple[Key, Key | None, Record]]) -> None:
        if self.spill is None:
            return
        for key, parent, record in spills:
            try:
                self.spill(key, parent, record)
            except Exception:  # noqa: BLE001 - a failing disk tier costs the record, not the put
                log.exception("spilling a record to the disk tier failed")
                with self._lock:
                    self._spill_errors += 1
                continue
            with self._lock:
                self._spilled += 1
