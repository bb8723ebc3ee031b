"""One loaded tokenizer for every loaded model whose tokenizer files are the same bytes (the
forms of one model: bf16, q8, q4), counted by users so the last unload drops it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")


def tokenizer_key(path: Path) -> str:
    """Folders whose tokenizer files are the same bytes share one loaded tokenizer."""
    digest = hashlib.blake2b(digest_size=16)
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    config = path / "config.json"
    if config.is_file():  # the EOS ids load_tokenizer reads from it
        digest.update(repr(json.loads(config.read_text()).get("eos_token_id")).encode())
    return digest.hexdigest()


class SharedTokenizers:
    """key (tokenizer_key) -> the loaded tokenizer and how many loaded models use it."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, int]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def get(self, key: str) -> Any:
        """The tokenizer a loaded model already holds under `key`, else None."""
        held = self._held.get(key)
        return held[0] if held else None

    def take(self, key: str, tokenizer: Any) -> None:
        """A model now uses `tokenizer` under `key` (the shared one, or its own if none was)."""
        held = self._held.get(key)
        self._held[key] = (tokenizer, (held[1] if held else 0) + 1)

    def give_back(self, key: str) -> None:
        """A model that used `key` is unloaded; the last one's unload drops the tokenizer."""
        tokenizer, users = self._held.pop(key, (None, 1))
        if users > 1:
            self._held[key] = (tokenizer, users - 1)
