"""Ollama's keep_alive values: how long a model stays loaded after its last request."""

from __future__ import annotations

from typing import Any


def parse_duration(value: Any) -> float | None:
    """Ollama's keep_alive: seconds as a number, or '30s', '15m', '2h', '1h30m'; negative means
    forever (returned as -1); None -> None (the server's default)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return -1.0 if value < 0 else float(value)
    text = str(value).strip().lower()
    if not text:
        return None
    try:
        number = float(text)
        return -1.0 if number < 0 else number
    except ValueError:
        pass
    total, digits, negative = 0.0, "", text.startswith("-")
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    rest = text.lstrip("-")
    index = 0
    while index < len(rest):
        char = rest[index]
        if char.isdigit() or char == ".":
            digits += char
            index += 1
            continue
        unit = "ms" if rest.startswith("ms", index) else char
        if unit not in units or not digits:
            raise ValueError(f"not a duration: {value!r} (try 30s, 15m, 2h, 0 or -1)")
        total += float(digits) * units[unit]
        digits = ""
        index += len(unit)
    if digits:
        raise ValueError(f"not a duration: {value!r} (a unit is missing: 30s, 15m, 2h)")
    return -1.0 if negative else total
