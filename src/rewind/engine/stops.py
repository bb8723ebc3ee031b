"""Streaming text out of tokens, with stop strings matched across token boundaries.

A stop string can arrive split over several tokens ("<|e" + "nd|>"), so text that could still
become the start of a stop string is held back until the next token decides it. Text after a
matched stop string is never released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TextStep:
    text: str  # text released by this step (may be empty)
    stop: str | None = None  # the stop string that matched, if one did (generation must end)


class StopStringFilter:
    """Holds back text that may still turn into a stop string; finds stop strings in the stream."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""  # text received but not released yet

    def feed(self, text: str) -> TextStep:
        self._pending += text
        if not self.stops:
            released, self._pending = self._pending, ""
            return TextStep(released)
        # Everything already released was checked not to start a stop string, so a match can
        # only begin inside the pending text; take the earliest one.
        first: tuple[int, str] | None = None
        for stop in self.stops:
            at = self._pending.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            released = self._pending[: first[0]]
            self._pending = ""
            return TextStep(released, stop=first[1])
        hold = self._longest_stop_prefix_suffix()
        cut = len(self._pending) - hold
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return TextStep(released)

    def flush(self) -> str:
        """The held-back text, released at the end of generation (no stop matched)."""
        released, self._pending = self._pending, ""
        return released

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:length]):
                    best = length
                    break
        return best


class TextStream:
    """Tokens in, releasable text out: mlx-lm's streaming detokenizer plus the stop filter."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self._detokenizer = tokenizer.detokenizer  # a fresh, reset copy per access
        self._filter = StopStringFilter(stops)
        self.finished = False

    def add(self, token: int) -> TextStep:
        self._detokenizer.add_token(token)
        step = self._filter.feed(self._detokenizer.last_segment)
        self.finished = step.stop is not None
        return step

    def finish(self) -> TextStep:
        """End of generation without a stop string: release everything (partial chars included).
        The finishing token must not be added to the detokenizer when it is not text (EOS)."""
        self._detokenizer.finalize()
        step = self._filter.feed(self._detokenizer.last_segment)
        if step.stop is not None:
            return step
        return TextStep(step.text + self._filter.flush())
