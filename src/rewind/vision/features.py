"""A bounded LRU of vision-tower outputs, keyed by the SHA-256 of the image bytes.

The tower is the costly part of an image prompt that the prompt cache cannot always skip: a new
turn after an image restores the image's tokens from the prompt cache, but a prompt that differs
before the image (another system prompt, another tenant salt) must prefill the image tokens again,
and with this LRU it does so from the stored features instead of re-running the tower.

Entries are evaluated MLX arrays owned by the engine thread (the only thread that creates or
reads them); the lock only keeps the bookkeeping sound if stats are read from elsewhere.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024


class FeatureLRU:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: bytes) -> Any | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, features: Any) -> bool:
        """Keep `features` (an evaluated mx.array); False when it alone exceeds the budget."""
        nbytes = int(features.nbytes)
        if nbytes > self.budget_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= int(old.nbytes)
            self._entries[key] = features
            self._bytes += nbytes
            while self._bytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= int(evicted.nbytes)
                self.evictions += 1
        return True

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes,
                    "budget_bytes": self.budget_bytes, "hits": self.hits, "misses": self.misses,
                    "evictions": self.evictions}
