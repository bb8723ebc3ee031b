"""The disk tier's file itself: opening one that has no name, and reading or writing a whole
byte range of it through FileIO (the seam tests put faults under).

The file is opened with O_TMPFILE (or created and unlinked at once where that is missing), so
nothing remains after close, exit or kill -9.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from rewind.cache.file_io import FileIO


def open_anonymous_file(folder: Path, use_o_tmpfile: bool = True) -> int:
    """A read-write fd on a file in `folder` that has no name (raises OSError)."""
    flag = getattr(os, "O_TMPFILE", None)
    if use_o_tmpfile and flag is not None:
        try:
            return os.open(folder, flag | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as error:
            # Filesystems without O_TMPFILE say EOPNOTSUPP/EISDIR/EINVAL; fall back. Anything
            # else (EACCES, ENOENT, ...) would fail the fallback the same way.
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    fd, name = tempfile.mkstemp(prefix="rewind-scratch-", dir=folder)
    try:
        os.unlink(name)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_exact(io: FileIO, fd: int, offset: int, length: int) -> bytes:
    """`length` bytes at `offset`; OSError(EIO) if the file ends first."""
    # One pread gives the whole range from a regular file (no zero-filled buffer to copy
    # into); a short read means the file is shorter than the index says.
    blob = io.pread(fd, length, offset)
    if len(blob) == length:
        return blob
    parts = [blob]
    done = len(blob)
    while done < length:
        part = io.pread(fd, length - done, offset + done)
        if not part:
            raise OSError(errno.EIO, f"short read: {done} of {length} bytes")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def write_all(io: FileIO, fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write `buffers` back to back from `offset`, retrying short writes."""
    position = offset
    for buffer in buffers:
        done = 0
        while done < len(buffer):
            count = io.pwrite(fd, buffer[done:], position)
            if count <= 0:
                raise OSError(errno.EIO, f"pwrite wrote {count} bytes")
            done += count
            position += count
