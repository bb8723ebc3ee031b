"""The disk tier's free space: byte ranges of its file that records no longer hold.

Ranges are kept coalesced, so a freed neighbour always merges; a write takes the best fit (the
smallest range that holds it), and free space that reaches the end of the file moves the end
down, so the store can truncate the file.
"""

from __future__ import annotations

import bisect


class FreeList:
    """Free byte ranges of a file, kept coalesced, plus the file's logical end."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted starts of free ranges
        self._lengths: dict[int, int] = {}  # start -> length
        self.end = 0  # bytes the file spans: every range lies below it

    @property
    def free_bytes(self) -> int:
        return sum(self._lengths.values())

    def ranges(self) -> list[tuple[int, int]]:
        return [(start, self._lengths[start]) for start in self._starts]

    def take_hole(self, length: int) -> int | None:
        """Best fit among the free ranges (the smallest that holds `length`); None if none."""
        best: int | None = None
        for start in self._starts:
            size = self._lengths[start]
            if size >= length and (best is None or size < self._lengths[best]):
                best = start
                if size == length:
                    break
        if best is None:
            return None
        size = self._lengths.pop(best)
        index = bisect.bisect_left(self._starts, best)
        del self._starts[index]
        if size > length:
            self._insert(best + length, size - length)
        return best

    def append(self, length: int) -> int:
        """A range at the end of the file."""
        offset = self.end
        self.end += length
        return offset

    def release(self, offset: int, length: int) -> bool:
        """Return a range, merging it with free neighbours. True if the file end moved down."""
        if length <= 0:
            return False
        index = bisect.bisect_left(self._starts, offset)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._lengths[before] > offset:
                raise ValueError(f"range {offset}+{length} overlaps free range at {before}")
            if before + self._lengths[before] == offset:
                offset, length = before, self._lengths.pop(before) + length
                del self._starts[index - 1]
                index -= 1
        if index < len(self._starts):
            after = self._starts[index]
            if offset + length > after:
                raise ValueError(f"range {offset}+{length} overlaps free range at {after}")
            if offset + length == after:
                length += self._lengths.pop(after)
                del self._starts[index]
        if offset + length >= self.end:
            self.end = offset  # free space reached the end: the file can shrink
            return True
        self._insert(offset, length)
        return False

    def _insert(self, offset: int, length: int) -> None:
        bisect.insort(self._starts, offset)
        self._lengths[offset] = length
