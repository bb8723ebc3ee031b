"""The disk tier: one anonymous scratch file holding safetensors records.

The file has no name (scratch_file.py): nothing remains after close, exit or kill -9. An
in-memory index maps each key to (offset, length, checksum). Freed ranges go to a coalescing
free list (free_list.py) that later writes reuse (best fit); when free space reaches the end of
the file, the file is truncated. A chain-aware LRU keeps the bytes of stored and queued records
under the budget, and the file itself never grows past the budget either (fragmentation is
paid for by evicting more).

put() only budgets the record and queues it: the writer thread serializes the (already
evaluated) arrays and pwrites them, outside the lock, into a range that no reader can see yet.
get() preads under the lock (so a range cannot be freed and reused mid-read) and verifies the
checksum outside it. Any disk fault costs the record, never an exception in the caller: the
cache only makes answers faster, so a failing disk must only make them slower.

With persist=True (rewind serve --cache-persist) the file is named instead and reopened by the
next process, with an index snapshotted every N records or T seconds and at close; each record
is framed with its key and checked when it is read (file format and lock: persist.py; when
and what to snapshot, and which entries to trust at open: store_index.py). A store whose
writer has been idle T seconds with records not yet in the index writes it then, so a process
killed later (kill -9, a crash) loses nothing it wrote.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

import mlx.core as mx
import xxhash

from rewind.cache import persist as fmt
from rewind.cache.file_io import FileIO
from rewind.cache.free_list import FreeList
from rewind.cache.lru import ChainLRU
from rewind.cache.scratch_file import open_anonymous_file, read_exact, write_all
from rewind.cache.serialize import (
    EncodedLayout,
    Record,
    RecordFormatError,
    array_buffers,
    decode_record,
    layout,
    wire_arrays,
)
from rewind.cache.store_index import StoreIndex, trusted_entries
from rewind.cache.writer import Writer

Key = Hashable
log = logging.getLogger(__name__)

# Errors that mean "the device (or this process's file-size limit) holds no more": the file
# then stops growing and later records make room by evicting, until this many seconds pass.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FULL_RETRY_SECONDS = 60.0
# A failing disk fails every record: one log line per kind of fault this often, the rest counted.
_FAULT_LOG_SECONDS = 600.0


@dataclass(frozen=True)
class Slot:
    offset: int
    length: int
    checksum: int  # xxh3-128 of the blob


@dataclass
class _Pending:
    parent: Key | None
    record: Record  # what get() returns while the record waits for the disk
    words: list[mx.array]  # its arrays as the blob holds them, evaluated
    layout: EncodedLayout
    frame: bytes = b""  # persistent stores: the key's frame, written before the blob
    note: bytes = b""  # persistent stores: the caller's note, kept in the index

    @property
    def size(self) -> int:
        return len(self.frame) + self.layout.size


class ScratchStore:
    """key -> Record in one scratch file under `budget_bytes`, written in the background."""

    def __init__(
        self,
        folder: Path | str,
        budget_bytes: int,
        queue_size: int = 64,
        *,
        queue_bytes: int = 256 << 20,
        use_o_tmpfile: bool = True,
        io: FileIO | None = None,
        persist: bool = False,
        snapshot_records: int = 64,
        snapshot_seconds: float = 5.0,
    ) -> None:
        self.folder = Path(folder)
        # Persistence (see persist.py): a named data file and index in `folder`, reopened by
        # the next process; off, or when another process owns the folder: an anonymous file.
        self.persistent = False
        self._index: StoreIndex | None = None  # set while this process owns the folder
        self._notes: dict[Key, bytes] = {}
        self._changes = 0  # index changes since the last snapshot
        # changes taken by a snapshot whose index file is still being written: a kill -9 now
        # loses them as much as those not yet taken
        self._changes_writing = 0
        self._io = io or FileIO()
        self._fault_logged: dict[str, float] = {}  # kind -> when it was last logged
        self.budget_bytes = budget_bytes
        self.enabled = False
        self.disabled_reason: str | None = None
        self._lock = threading.Lock()
        self._slots: dict[Key, Slot] = {}
        self._pending: dict[Key, _Pending] = {}
        # Records waiting for the disk hold RAM: bound them in bytes as well as in count, so a
        # slow disk makes the engine wait instead of growing the process.
        self.queue_bytes = queue_bytes
        self._pending_bytes = 0
        self._drained = threading.Condition(self._lock)
        self._free = FreeList()
        self._file_limit = budget_bytes  # lowered to what the disk took when it is full
        self._file_limit_until = 0.0  # when a lowered limit may be tried higher again
        self._lru = ChainLRU(max(budget_bytes, 0), on_evict=self._on_evict)
        self._counts = {
            "hits": 0,
            "misses": 0,
            "bytes_written": 0,
            "records_written": 0,
            "corrupt": 0,
            "write_errors": 0,
            "read_errors": 0,
            "rejected": 0,  # larger than the budget allows, or refused after close
            "no_space": 0,  # the file could not make room within the budget
            "disk_full": 0,  # writes refused by the device (ENOSPC, EDQUOT, EFBIG)
            "queue_waits": 0,  # times put() waited for queued bytes to drain
            "loaded_records": 0,  # records found in the index at open (persistent stores)
            "loaded_bytes": 0,
            "snapshots": 0,  # index snapshots written
            "snapshot_errors": 0,
            "set_aside": 0,  # unreadable or foreign files renamed out of the way at open
        }
        self.last_error: str | None = None
        self._fd = -1
        self._writer: Writer[Key] | None = None
        if budget_bytes <= 0:
            self.disabled_reason = f"disk budget is {budget_bytes} bytes"
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if persist:
                self._open_persistent(snapshot_records, snapshot_seconds)
            if not self.persistent:
                self._fd = open_anonymous_file(self.folder, use_o_tmpfile)
        except OSError as error:
            self._close_persistent_files()
            self.disabled_reason = f"cannot open a scratch file in {self.folder}: {error}"
            log.warning("disk cache disabled: %s", self.disabled_reason)
            return
        self._writer = Writer(self._write_job, queue_size, name="rewind-disk-writer",
                              on_idle=self._snapshot_if_changed if self.persistent else None,
                              idle_seconds=snapshot_seconds)
        self.enabled = True

    # ---- the API -----------------------------------------------------------------------
    def put(self, key: Key, parent: Key | None, record: Record, note: bytes = b"") -> bool:
        """Queue `record` for the disk; False if it will not be stored (the reason is counted).

        `note`: a few bytes kept beside the key in a persistent store's index (notes()).
        Blocks only while the writer's queue is full. Never raises on disk trouble.
        """
        if not self.enabled:
            return False
        # Every MLX operation (the bf16 reinterpretation, any evaluation still owed) happens
        # here on the caller's thread; the writer thread only reads finished buffers.
        try:
            words = wire_arrays(record)
            mx.eval(words)
            encoded = layout(record)
            framed = fmt.frame(key) if self.persistent else b""
            if len(note) > 0xFFFF:
                raise ValueError(f"a note of {len(note)} bytes")
        except Exception as error:  # noqa: BLE001 - an unstorable record is only not stored
            with self._lock:
                self._counts["rejected"] += 1
                self.last_error = f"cannot encode record: {error!r}"
            return False
        with self._lock:
            if not self.enabled:
                return False
            if key in self._slots or key in self._pending:
                self._lru.touch(key)
                return True
            size = len(framed) + encoded.size
            while (
                self._pending_bytes > 0
                and self._pending_bytes + size > self.queue_bytes
                and self.enabled
            ):
                self._counts["queue_waits"] += 1
                self._drained.wait(timeout=1.0)
            if not self.enabled:
                return False
            if key in self._slots or key in self._pending:
                self._lru.touch(key)
                return True
            if not self._lru.add(key, parent, size):
                self._counts["rejected"] += 1
                return False
            self._pending[key] = _Pending(parent, record, words, encoded, framed, bytes(note))
            self._pending_bytes += size
            writer = self._writer
        if writer is None or not writer.submit(key):
            with self._lock:
                self._drop_subtree(key)
                self._counts["rejected"] += 1
            return False
        return True

    def get(self, key: Key) -> Record | None:
        """The record, or None when absent, unreadable or corrupt (a bad one is dropped)."""
        if not self.enabled:
            return None
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:  # still queued: the arrays are right here
                self._lru.touch(key)
                self._counts["hits"] += 1
                return pending.record
            slot = self._slots.get(key)
            if slot is None:
                self._counts["misses"] += 1
                return None
            self._lru.touch(key)
            try:
                blob = read_exact(self._io, self._fd, slot.offset, slot.length)
            except OSError as error:
                self._counts["misses"] += 1
                self._fault("read_errors", f"read {slot.length} bytes at {slot.offset}: {error}")
                self._drop_subtree(key)
                return None
        framed = fmt.frame(key) if self.persistent else b""
        if xxhash.xxh3_128_intdigest(blob) == slot.checksum and blob.startswith(framed):
            try:
                record = decode_record(memoryview(blob)[len(framed):])
            except RecordFormatError as error:
                with self._lock:
                    self._fault("corrupt", f"a record passed its checksum but does not decode: "
                                f"{error}")
                    self._counts["misses"] += 1
                    if self._slots.get(key) == slot:
                        self._drop_subtree(key)
                return None
            else:
                with self._lock:
                    self._counts["hits"] += 1
                return record
        with self._lock:
            self._fault("corrupt", f"the record at {slot.offset} ({slot.length} bytes) fails "
                        "its checksum")
            self._counts["misses"] += 1
            if self._slots.get(key) == slot:
                self._drop_subtree(key)
        return None

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._slots or key in self._pending

    def __contains__(self, key: Key) -> bool:
        return self.contains(key)

    def touch(self, key: Key) -> None:
        with self._lock:
            self._lru.touch(key)

    def discard(self, key: Key) -> int:
        """Drop `key` and its descendants (a chain keeps no hole); returns how many."""
        with self._lock:
            return len(self._drop_subtree(key))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued record is written or dropped (tests, shutdown)."""
        writer = self._writer
        return True if writer is None else writer.flush(timeout)

    def close(self) -> None:
        """Stop the writer and close the file. An anonymous file vanishes (queued records are
        dropped); a persistent store writes what is queued, syncs and writes a final index."""
        writer = self._writer
        if writer is not None:
            writer.close(drain=self.persistent)
        if self.persistent and self.enabled:
            with self._lock:
                fd = self._fd
            try:
                os.fdatasync(fd)
            except OSError:
                pass
            self.snapshot()
        with self._lock:
            self.enabled = False
            if self.disabled_reason is None:
                self.disabled_reason = "closed"
            self._slots.clear()
            self._pending.clear()
            self._pending_bytes = 0
            self._drained.notify_all()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self._close_persistent_files()

    def __enter__(self) -> "ScratchStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {
                "enabled": self.enabled,
                "disabled_reason": self.disabled_reason,
                "entries": len(self._slots) + len(self._pending),
                "queued": len(self._pending),
                "queued_bytes": self._pending_bytes,
                "bytes": self._lru.total_bytes,
                "budget_bytes": self.budget_bytes,
                "evictions": self._lru.evictions,
                "file_bytes": self._free.end,
                "file_limit": self._file_limit,
                "free_bytes": self._free.free_bytes,
                "last_error": self.last_error,
                "persistent": self.persistent,
                # Index changes not yet in the index file: records a kill -9 now would lose.
                "unindexed_changes": (self._changes + self._changes_writing
                                      if self.persistent else 0),
                **self._counts,
            }

    # ---- persistence (see persist.py) ---------------------------------------------------
    def snapshot(self) -> bool:
        """Write the index (atomically replacing the last one); False if not persistent or the
        write failed (counted; the previous index stays and is still safe to open)."""
        index = self._index
        if not self.persistent or index is None:
            return False
        with index.writing:
            with self._lock:
                if self._fd < 0:
                    return False
                taken = index.take(self._lru, self._slots, self._notes, self._free.end)
                writing, self._changes = self._changes, 0
                self._changes_writing += writing
            try:
                index.write(taken)
            except OSError as error:
                with self._lock:
                    self._changes_writing -= writing
                    # still unindexed: the writer's next idle snapshot tries again
                    self._changes += writing
                    self._fault("snapshot_errors", f"cannot write the index in {self.folder}: "
                                f"{error}")
                return False
            with self._lock:
                self._changes_writing -= writing
                self._counts["snapshots"] += 1
            return True

    def _snapshot_if_changed(self) -> None:
        """The writer thread, idle `snapshot_seconds`: write the index if it changed since the
        last snapshot (records that came after a burst would otherwise wait for the next write,
        and die with the process if it is killed first)."""
        with self._lock:
            changed = self._changes > 0 and self._fd >= 0
        if changed:
            self.snapshot()

    def notes(self) -> list[tuple[Key, Key | None, bytes]]:
        """(key, parent, note) of the stored records that were put with a note."""
        with self._lock:
            return [(key, self._lru.parent(key), note) for key, note in self._notes.items()
                    if key in self._lru]

    def note_model(self, fingerprint: str) -> None:
        """Remember that a model with this fingerprint uses the store (`rewind cache stats`)."""
        with self._lock:
            if self._index is not None:
                self._index.models[fingerprint] = time.time()

    def _open_persistent(self, snapshot_records: int, snapshot_seconds: float) -> None:
        """Own the folder and reopen its data file and index; leaves self.persistent False
        (the caller opens an anonymous file) when another process owns the folder."""
        index = StoreIndex(self.folder, snapshot_records, snapshot_seconds)
        if not index.own_folder():
            log.warning("prompt cache folder %s is owned by another Rewind process (%s is "
                        "locked): this server uses a private scratch file instead, which is not "
                        "kept after it stops", self.folder, index.lock_path)
            return
        self._index = index
        started = time.perf_counter()
        try:
            last = fmt.read_index(self.folder)
        except fmt.IndexFormatError as error:
            moved = fmt.set_aside(self.folder)
            self._counts["set_aside"] += 1
            log.warning("prompt cache in %s not trusted (%s): set aside as %s; starting empty",
                        self.folder, error, ", ".join(p.name for p in moved) or "nothing")
            last = None
        self._fd = index.open_data_file()
        self.persistent = True
        if last is None:
            # No index (a new folder, or killed before the first snapshot): nothing in the data
            # file can be trusted, so it starts over.
            self._io.ftruncate(self._fd, 0)
            return
        index.remember_models(last.meta)
        self._load_index(last)
        log.info("prompt cache: reopened %d records (%d bytes) from %s in %.3f s",
                 self._counts["loaded_records"], self._counts["loaded_bytes"], self.folder,
                 time.perf_counter() - started)

    def _load_index(self, index: fmt.Index) -> None:
        """Slots, free list and LRU order from the index. Records are not read here: each is
        checked when it is used."""
        size = os.fstat(self._fd).st_size
        usable = trusted_entries(index.entries, size)
        with self._lock:
            self._free.end = usable[-1].offset + usable[-1].length if usable else 0
            position = 0
            for entry in usable:
                if entry.offset > position:
                    self._free.release(position, entry.offset - position)
                position = entry.offset + entry.length
            keep = {id(entry) for entry in usable}
            for entry in index.entries:  # oldest use first: the LRU's order comes back
                if id(entry) not in keep:
                    continue  # its range was never taken
                if entry.key in self._slots or not self._lru.add(entry.key, entry.parent,
                                                                  entry.length):
                    self._release(entry.offset, entry.length)  # a duplicate, or too large
                    continue
                self._slots[entry.key] = Slot(entry.offset, entry.length, entry.checksum)
                if entry.note:
                    self._notes[entry.key] = entry.note
            self._counts["loaded_records"] = len(self._slots)
            self._counts["loaded_bytes"] = self._lru.total_bytes
            self._changes = 0
        if size > self._free.end:
            try:  # records written after the snapshot are lost: give their space back
                self._io.ftruncate(self._fd, self._free.end)
            except OSError:
                pass

    def _close_persistent_files(self) -> None:
        if self._index is not None:
            self._index.release_folder()

    def drop_page_cache(self) -> bool:
        """Sync the file and ask the kernel to drop its cached pages, so the next reads come
        from the device (benchmarks of cold restores). False where that is not possible."""
        with self._lock:
            if self._fd < 0 or not hasattr(os, "posix_fadvise"):
                return False
            try:
                os.fsync(self._fd)
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                return False
            return True

    # ---- test hooks --------------------------------------------------------------------
    def _debug_corrupt(self, key: Key, at: int = -1) -> None:
        """Flip one byte of a written record in the file (tests of the checksum path)."""
        with self._lock:
            slot = self._slots[key]
            position = slot.offset + (at % slot.length)
            (byte,) = os.pread(self._fd, 1, position)
            os.pwrite(self._fd, bytes([byte ^ 0xFF]), position)

    def _debug_file_size(self) -> int:
        """The size the kernel reports for the scratch file."""
        with self._lock:
            return os.fstat(self._fd).st_size

    def _debug_slots(self) -> dict[Key, Slot]:
        with self._lock:
            return dict(self._slots)

    # ---- the writer thread -------------------------------------------------------------
    def _write_job(self, key: Key) -> None:
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                return  # evicted or dropped while queued
        try:
            buffers = [memoryview(pending.frame), memoryview(pending.layout.header),
                       *array_buffers(pending.words)]
            hasher = xxhash.xxh3_128()
            for buffer in buffers:
                hasher.update(buffer)
            checksum = hasher.intdigest()
            if sum(len(b) for b in buffers) != pending.size:
                raise RecordFormatError("array bytes disagree with the record's layout")
        except Exception as error:  # noqa: BLE001 - a record that cannot be encoded is lost, only
            with self._lock:
                self._fail(key, pending, f"encode: {error!r}")
            return
        size = pending.size
        with self._lock:
            if self._pending.get(key) is not pending:
                return  # evicted meanwhile
            offset = self._allocate(size, key)
            if offset is None:
                self._counts["no_space"] += 1
                self._drop_subtree(key)
                return
        try:
            write_all(self._io, self._fd, buffers, offset)
        except OSError as error:
            with self._lock:
                self._release(offset, size)
                if error.errno in _FULL_ERRNOS:
                    # Keep the file where the device stopped it; newer records now evict
                    # older ones, as with a smaller budget, instead of failing one by one.
                    self._fault("disk_full", f"the device holds no more ({error}); the file "
                                f"stays at {self._free.end} bytes for now")
                    self._file_limit = min(self._file_limit, self._free.end)
                    self._file_limit_until = time.monotonic() + _FULL_RETRY_SECONDS
                    self._counts["write_errors"] += 1  # counted, logged once above
                    self._drop_pending_subtree(key, pending)
                else:
                    self._fail(key, pending, f"write {size} bytes at {offset}: {error}")
            return
        with self._lock:
            # The same key may have been evicted and put again while these bytes went out:
            # only this job's own pending entry turns into a slot.
            if self._pending.get(key) is pending:
                self._pop_pending(key)
                self._slots[key] = Slot(offset, size, checksum)
                if pending.note:
                    self._notes[key] = pending.note
                self._changes += 1
                self._counts["bytes_written"] += size
                self._counts["records_written"] += 1
            else:  # evicted while its bytes were going out
                self._release(offset, size)
        if self.persistent and self._index is not None and self._index.due(self._changes):
            self.snapshot()

    # ---- internals (called with the lock held) -----------------------------------------
    def _allocate(self, size: int, key: Key) -> int | None:
        """A range of `size` bytes inside the budget, evicting LRU leaves (never `key`'s chain)."""
        if self._file_limit < self.budget_bytes and time.monotonic() >= self._file_limit_until:
            self._file_limit = self.budget_bytes  # the disk may have room again: try
        while True:
            offset = self._free.take_hole(size)
            if offset is not None:
                return offset
            if self._free.end + size <= self._file_limit:
                return self._free.append(size)
            if self._lru.evict_one(protect=key) is None:
                return None

    def _on_evict(self, key: Key, parent: Key | None, nbytes: int) -> None:
        self._forget(key)

    def _forget(self, key: Key) -> None:
        """Free what `key` holds; a key being written frees its range when the write ends."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._release(slot.offset, slot.length)
            self._notes.pop(key, None)
            self._changes += 1
        self._pop_pending(key)

    def _pop_pending(self, key: Key) -> _Pending | None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._pending_bytes -= pending.size
            self._drained.notify_all()
        return pending

    def _drop_subtree(self, key: Key) -> list[Key]:
        dropped = self._lru.remove_subtree(key)
        for node in dropped:
            self._forget(node)
        return dropped

    def _fault(self, kind: str, message: str) -> None:
        """Count a fault of `kind` (a key of _counts) and log it, once per kind every
        _FAULT_LOG_SECONDS: a failing disk fails every record, and the log is not the place to
        count them (/metrics is)."""
        self._counts[kind] += 1
        self.last_error = message
        now = time.monotonic()
        last = self._fault_logged.get(kind)
        if last is None or now - last >= _FAULT_LOG_SECONDS:
            self._fault_logged[kind] = now
            log.warning("prompt cache disk tier: %s (answers are unaffected: those records are "
                        "recomputed; %d fault(s) of this kind so far, all counted in /metrics "
                        "as rewind_prompt_cache_disk_faults_total{kind=%r})",
                        message, self._counts[kind], kind)

    def _fail(self, key: Key, pending: _Pending, message: str) -> None:
        self._fault("write_errors", message)
        self._drop_pending_subtree(key, pending)

    def _drop_pending_subtree(self, key: Key, pending: _Pending) -> None:
        if self._pending.get(key) is pending:  # not a newer put of the same key
            self._drop_subtree(key)

    def _release(self, offset: int, length: int) -> None:
        if self._free.release(offset, length) and self._fd >= 0:
            try:
                self._io.ftruncate(self._fd, self._free.end)
            except OSError as error:  # the space stays allocated; the index is still right
                self.last_error = f"truncate to {self._free.end}: {error}"
