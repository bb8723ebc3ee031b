"""A persistent store's index in use (rewind serve --cache-persist): the folder it owns, which
entries of the last snapshot can be trusted at open, and when and what to snapshot next.

The file formats and the folder lock are persist.py's; the records, their slots and the free
list stay the store's (store.py), which hands its state in here to be written out.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Hashable, Mapping, Protocol, Sequence

from rewind.cache import persist as fmt

Key = Hashable


class _Placed(Protocol):
    """Where a record lies in the data file (the store's Slot)."""

    offset: int
    length: int
    checksum: int


class _Recency(Protocol):
    """The store's LRU, as far as a snapshot reads it."""

    def keys_by_recency(self) -> list[Key]: ...

    def parent(self, key: Key) -> Key | None: ...


class StoreIndex:
    """Owns the folder (its flock) while the store is open; snapshots the store's index."""

    def __init__(self, folder: Path, snapshot_records: int, snapshot_seconds: float) -> None:
        self.folder = folder
        self.snapshot_records = max(1, snapshot_records)
        self.snapshot_seconds = snapshot_seconds
        self.models: dict[str, float] = {}  # fingerprints that used this store -> last seen
        self.last_snapshot = time.monotonic()
        self.writing = threading.Lock()  # one snapshot at a time
        self._folder_lock = fmt.FolderLock(folder)

    @property
    def lock_path(self) -> Path:
        return self._folder_lock.path

    def own_folder(self) -> bool:
        """True if this process now owns the folder; False if another Rewind process does."""
        return self._folder_lock.acquire()

    def release_folder(self) -> None:
        self._folder_lock.release()

    def open_data_file(self) -> int:
        """A read-write fd on the folder's data file (created if missing; raises OSError)."""
        return os.open(self.folder / fmt.DATA_NAME,
                       os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)

    def remember_models(self, meta: Mapping[str, object]) -> None:
        """The models the last process recorded, so `rewind cache stats` keeps naming them."""
        models = meta.get("models")
        if isinstance(models, dict):
            self.models.update({str(k): float(v) for k, v in models.items()
                                if isinstance(v, (int, float))})

    def due(self, changes: int) -> bool:
        """Whether `changes` index changes since the last snapshot call for the next one."""
        return (changes >= self.snapshot_records
                or time.monotonic() - self.last_snapshot >= self.snapshot_seconds)

    def take(self, lru: _Recency, slots: Mapping[Key, _Placed], notes: Mapping[Key, bytes],
             file_end: int) -> fmt.Index:
        """The index of the store's state now (the caller holds the store's lock), oldest use
        first so that replaying it restores the LRU's order."""
        entries = []
        for key in lru.keys_by_recency():
            slot = slots.get(key)
            if slot is not None:
                entries.append(fmt.Entry(key, lru.parent(key), slot.offset, slot.length,
                                         slot.checksum, notes.get(key, b"")))
        meta = {"file_end": file_end, "models": dict(self.models), "written": time.time()}
        self.last_snapshot = time.monotonic()
        return fmt.Index(entries, meta)

    def write(self, index: fmt.Index) -> None:
        """Replace the index file atomically (raises OSError; the previous one then stays)."""
        fmt.write_index(self.folder, index)


def trusted_entries(entries: Sequence[fmt.Entry], file_size: int) -> list[fmt.Entry]:
    """The entries that lie inside the file and overlap no earlier one, by offset: a damaged
    index must not hand one range to two keys."""
    usable: list[fmt.Entry] = []
    taken_end = 0
    for entry in sorted(entries, key=lambda e: e.offset):
        if entry.length <= 0 or entry.offset < taken_end or entry.offset + entry.length > file_size:
            continue
        usable.append(entry)
        taken_end = entry.offset + entry.length
    return usable
