"""The prompt cache's tiers: `open_store` opens the disk tier, and SharedTiers holds one RAM tier
and one disk file for the prompt caches of every model a server holds.

Each model keeps its own PromptCache (its partial-point index, its counters), but their records
live in these tiers under one chain-aware LRU: a model that is used keeps its prefixes hot, one
that is not used gives its RAM to the others. Block keys start from a root that hashes the
model's fingerprint, so two models' records never answer for each other.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from rewind.cache.file_io import file_io
from rewind.cache.ram_tier import RamTier
from rewind.cache.serialize import Record
from rewind.cache.store import ScratchStore
from rewind.config import CacheConfig, default_disk_budget
from rewind.paths import scratch_dir

log = logging.getLogger(__name__)


def open_store(config: CacheConfig) -> ScratchStore | None:
    """The disk tier, or None when it is off or cannot be opened (never fatal): shared by the
    models of a SharedTiers, or a PromptCache's own."""
    if not config.disk_enabled:
        return None
    folder = Path(config.cache_dir) if config.cache_dir else scratch_dir()
    try:
        budget = config.disk_bytes if config.disk_bytes is not None else default_disk_budget(folder)
        store = ScratchStore(folder, budget, queue_size=config.writer_queue,
                             io=file_io(config.disk_faults), persist=config.persist,
                             snapshot_records=config.snapshot_records,
                             snapshot_seconds=config.snapshot_seconds)
    except Exception as error:  # noqa: BLE001 - a broken disk tier costs recompute, not a crash
        log.warning("disk tier disabled: %s", error)
        return None
    if not store.enabled:
        log.warning("disk tier disabled: %s", store.disabled_reason)
    return store


class SharedTiers:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.store = open_store(config) if config.enabled else None
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
