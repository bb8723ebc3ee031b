"""The span a decode tokens/s is timed over when N streams arrive together: the scheduler prefills
them in chunks while earlier streams already decode, so only the window where all N decode
counts (from the last stream's first token to the first stream's last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

@dataclass
class Window:
    """The span where every stream decodes: after the last stream's first token, up to the
    first stream's last."""

    seconds: float
    tokens: int  # tokens of all streams stamped inside it
    mean_context: float  # tokens held per stream at its middle (prompt + generated)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def all_decoding_window(stamps: list[list[float]], prompt_tokens: int) -> Window:
    start = max(times[0] for times in stamps)
    end = min(times[-1] for times in stamps)
    tokens = sum(sum(1 for t in times if start < t <= end) for times in stamps)
    middle = (start + end) / 2
    held = [prompt_tokens + sum(1 for t in times if t <= middle) for times in stamps]
    return Window(end - start, tokens, sum(held) / len(held))


def stagger_tokens(streams: int, prompt_tokens: int, chunk_tokens: int) -> int:
    """Steps before the last of `streams` prompts arriving together can decode: the scheduler
    runs at least one prompt chunk per step, so at most this many."""
    return streams * math.ceil(prompt_tokens / chunk_tokens) + 8
