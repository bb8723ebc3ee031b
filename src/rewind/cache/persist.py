"""The persistent disk tier's files: a named data file, its index, and the folder's lock.

A folder holds (names below):
  rewind-cache.lock    flock'ed by the one process that owns the folder (a second server falls
                       back to a private anonymous scratch file);
  rewind-cache.data    the records, each a frame (magic, the record's key) and then its
                       safetensors blob; records sit at the offsets the index names, with holes;
  rewind-cache.index   a snapshot of the in-memory index, written to a temp file and renamed
                       over the old one (atomic), every N records or T seconds and at close.

Index file layout (little endian):
  magic b"RWNDIDX\\0" | u32 version | u32 meta length | meta (JSON: file_end, models, written)
  | u64 entry count | entries | xxh3-64 of everything before it (8 bytes)
  entry: u16 key length | key | u16 parent length (0xFFFF: none) | parent | u64 offset
         | u64 length | 16 bytes xxh3-128 checksum (of frame + blob) | u16 note length | note
Entries come oldest use first: replaying them into the LRU restores its order.

Nothing in the data file is trusted at open: a record is checked (length, checksum, the key in
its frame) when it is read, so opening a store of any size reads only the index, and a record
overwritten after the last snapshot (its range reused by a newer record) fails its check and is
a miss. Keys are bytes or str (tagged), as the prompt cache uses bytes.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterator

import xxhash

Key = Hashable

LOCK_NAME = "rewind-cache.lock"
DATA_NAME = "rewind-cache.data"
INDEX_NAME = "rewind-cache.index"
INDEX_MAGIC = b"RWNDIDX\0"
INDEX_VERSION = 1
FRAME_MAGIC = b"RWR1"
SET_ASIDE_SUFFIX = ".set-aside"
_NO_PARENT = 0xFFFF


class IndexFormatError(ValueError):
    """An index file this version does not read (foreign, older, newer or torn)."""


# ---- keys and frames ---------------------------------------------------------------------------

def key_bytes(key: Key) -> bytes:
    """A key as stored: a tag byte, then its bytes (b: bytes, s: UTF-8 str)."""
    if isinstance(key, (bytes, bytearray)):
        return b"b" + bytes(key)
    if isinstance(key, str):
        return b"s" + key.encode()
    raise TypeError(f"a persistent store keeps bytes or str keys, not {type(key).__name__}")


def key_from_bytes(data: bytes) -> Key:
    tag, body = data[:1], data[1:]
    if tag == b"b":
        return body
    if tag == b"s":
        return body.decode()
    raise IndexFormatError(f"unknown key tag {tag!r}")


def frame(key: Key) -> bytes:
    """What precedes a record's blob in the data file: it proves whose bytes these are."""
    encoded = key_bytes(key)
    return FRAME_MAGIC + struct.pack("<H", len(encoded)) + encoded


# ---- the index ---------------------------------------------------------------------------------

@dataclass
class Entry:
    key: Key
    parent: Key | None
    offset: int
    length: int
    checksum: int
    note: bytes = b""


@dataclass
class Index:
    entries: list[Entry] = field(default_factory=list)  # oldest use first
    meta: dict = field(default_factory=dict)


def encode_index(index: Index) -> bytes:
    meta = json.dumps(index.meta, sort_keys=True).encode()
    parts = [INDEX_MAGIC, struct.pack("<II", INDEX_VERSION, len(meta)), meta,
             struct.pack("<Q", len(index.entries))]
    for entry in index.entries:
        key = key_bytes(entry.key)
        parts.append(struct.pack("<H", len(key)) + key)
        if entry.parent is None:
            parts.append(struct.pack("<H", _NO_PARENT))
        else:
            parent = key_bytes(entry.parent)
            parts.append(struct.pack("<H", len(parent)) + parent)
        parts.append(struct.pack("<QQ", entry.offset, entry.length)
                     + entry.checksum.to_bytes(16, "little")
                     + struct.pack("<H", len(entry.note)) + entry.note)
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def decode_index(data: bytes) -> Index:
    if len(data) < len(INDEX_MAGIC) + 8 or not data.startswith(INDEX_MAGIC):
        raise IndexFormatError("not a Rewind cache index (bad magic)")
    version, meta_len = struct.unpack_from("<II", data, len(INDEX_MAGIC))
    if version != INDEX_VERSION:
        raise IndexFormatError(f"index format version {version}, this Rewind reads "
                               f"{INDEX_VERSION}")
    if len(data) < 8 or struct.unpack("<Q", data[-8:])[0] != xxhash.xxh3_64_intdigest(data[:-8]):
        raise IndexFormatError("index checksum mismatch (torn or damaged)")
    try:
        at = len(INDEX_MAGIC) + 8
        meta = json.loads(data[at:at + meta_len])
        at += meta_len
        (count,) = struct.unpack_from("<Q", data, at)
        at += 8
        entries = []
        for _ in range(count):
            (n,) = struct.unpack_from("<H", data, at)
            key = key_from_bytes(data[at + 2:at + 2 + n])
            at += 2 + n
            (n,) = struct.unpack_from("<H", data, at)
            at += 2
            parent = None
            if n != _NO_PARENT:
                parent = key_from_bytes(data[at:at + n])
                at += n
            offset, length = struct.unpack_from("<QQ", data, at)
            checksum = int.from_bytes(data[at + 16:at + 32], "little")
            (n,) = struct.unpack_from("<H", data, at + 32)
            note = data[at + 34:at + 34 + n]
            at += 34 + n
            entries.append(Entry(key, parent, offset, length, checksum, note))
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise IndexFormatError(f"malformed index: {error}") from error
    if at != len(data) - 8:
        raise IndexFormatError("index has trailing bytes")
    return Index(entries, meta if isinstance(meta, dict) else {})


def read_index(folder: Path) -> Index | None:
    """The folder's index; None when there is none. Raises IndexFormatError if unreadable."""
    try:
        data = (folder / INDEX_NAME).read_bytes()
    except FileNotFoundError:
        return None
    return decode_index(data)


def write_index(folder: Path, index: Index) -> int:
    """Write the index to a temp file, fsync it and rename it over the old one (atomic).
    Returns its size; raises OSError (the old index stays)."""
    data = encode_index(index)
    temp = folder / (INDEX_NAME + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        _unlink_quietly(temp)
        raise
    os.close(fd)
    try:
        os.replace(temp, folder / INDEX_NAME)
    except OSError:
        _unlink_quietly(temp)
        raise
    return len(data)


def set_aside(folder: Path) -> list[Path]:
    """Rename the data and index files out of the way (never trusted, kept for a person to look
    at); returns the new names."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for name in (DATA_NAME, INDEX_NAME):
        path = folder / name
        if path.exists():
            target = folder / f"{name}{SET_ASIDE_SUFFIX}-{stamp}-{os.getpid()}"
            os.replace(path, target)
            moved.append(target)
    return moved


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---- the lock ----------------------------------------------------------------------------------

class FolderLock:
    """An exclusive flock on the folder's lock file, held until release() (or the process dies)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        self._fd = -1

    def acquire(self) -> bool:
        """True if this process now owns the folder; False if another one does."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        try:  # who holds it, for people reading the folder
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0


# ---- offline tools (rewind cache stats|clear|verify) ------------------------------------------

def iter_records(folder: Path, index: Index) -> Iterator[tuple[Entry, str | None]]:
    """Each entry with None if its bytes check out, else why not (reads the whole store)."""
    try:
        fd = os.open(folder / DATA_NAME, os.O_RDONLY)
    except FileNotFoundError:
        for entry in index.entries:
            yield entry, "the data file is missing"
        return
    try:
        for entry in index.entries:
            yield entry, check_blob(entry, os.pread(fd, entry.length, entry.offset))
    finally:
        os.close(fd)


def check_blob(entry: Entry, blob: bytes) -> str | None:
    if len(blob) != entry.length:
        return f"short: {len(blob)} of {entry.length} bytes"
    if xxhash.xxh3_128_intdigest(blob) != entry.checksum:
        return "checksum mismatch"
    if not blob.startswith(frame(entry.key)):
        return "the frame names another key"
    return None
