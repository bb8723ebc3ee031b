"""The system calls the disk tier makes on its file, behind one small seam, so tests can put a
fault-injecting layer under the store: I/O errors, a full device, short writes, bytes that come
back changed. The store must turn every one of them into a miss (recompute), never into a crash
or a wrong answer."""

from __future__ import annotations

import os
import threading

from rewind.config import DiskFaults


class FileIO:
    """Plain positional I/O on one file descriptor."""

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        return os.pread(fd, length, offset)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)


class FaultyFileIO(FileIO):
    def __init__(self, faults: DiskFaults) -> None:
        self.faults = faults
        self._lock = threading.Lock()
        self._calls = {"read": 0, "write": 0}
        self.injected = {"read": 0, "write": 0}

    def _due(self, kind: str) -> bool:
        with self._lock:
            self._calls[kind] += 1
            count = self._calls[kind] - self.faults.after
            due = count > 0 and count % self.faults.every == 0
            if due:
                self.injected[kind] += 1
            return due

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        faults = self.faults
        if (faults.read_errno is not None or faults.flip_reads) and self._due("read"):
            if faults.read_errno is not None:
                raise OSError(faults.read_errno, os.strerror(faults.read_errno))
            data = bytearray(super().pread(fd, length, offset))
            if data:
                data[len(data) // 2] ^= 0x5A
            return bytes(data)
        return super().pread(fd, length, offset)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        faults = self.faults
        if (faults.write_errno is not None or faults.short_write) and self._due("write"):
            if faults.write_errno is not None:
                raise OSError(faults.write_errno, os.strerror(faults.write_errno))
            return super().pwrite(fd, memoryview(data)[:faults.short_write], offset)
        return super().pwrite(fd, data, offset)


def file_io(faults: DiskFaults | None) -> FileIO:
    return FileIO() if faults is None else FaultyFileIO(faults)

