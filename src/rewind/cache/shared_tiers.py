"""One RAM tier and one disk file for the prompt caches of every model a server holds.

Each model keeps its own PromptCache (its partial-point index, its counters), but their records
live in these tiers under one chain-aware LRU: a model that is used keeps its prefixes hot, one
that is not used gives its RAM to the others. Block keys start from a root that hashes the
model's fingerprint, so two models' records never answer for each other.
"""

from __future__ import annotations

import threading
from typing import Any

from rewind.cache.prompt_cache import _open_store
from rewind.cache.ram_tier import RamTier
from rewind.cache.serialize import Record
from rewind.config import CacheConfig


class SharedTiers:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.store = _open_store(config) if config.enabled else None
        self.ram = RamTier(config.ram_bytes, spill=self._spill)
        self._lock = threading.Lock()
        self._closed = False

    def _spill(self, key: Any, parent: Any, record: Record) -> None:
        """RAM evicted a record: keep it on disk (once), if there is a disk tier."""
        store = self.store
        if store is None or store.contains(key):
            return
        store.put(key, parent, record)

    def ram_bytes(self) -> int:
        return int(self.ram.stats()["bytes"])

    def shrink_ram(self, budget_bytes: int) -> int:
        """Spill the RAM tier down to `budget_bytes` (never above its configured size); returns
        the bytes it held before."""
        before = self.ram_bytes()
        self.ram.set_budget(max(0, min(budget_bytes, self.config.ram_bytes)))
        return before

    def restore_ram_budget(self, budget_bytes: int) -> None:
        """Let the RAM tier grow again, up to `budget_bytes` and its configured size."""
        self.ram.set_budget(max(0, min(budget_bytes, self.config.ram_bytes)))

    def stats(self) -> dict[str, Any]:
        """The shape of PromptCache.stats()'s tiers (what the metrics read)."""
        return {"ram": self.ram.stats(),
                "disk": self.store.stats() if self.store is not None else None}

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.ram.spill = None  # shutting down: nothing more goes to disk
            self.ram.clear()
            if self.store is not None:
                self.store.close()
                self.store = None
