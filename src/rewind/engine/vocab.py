"""How many logits a model gives: its config's `vocab_size` (or its text config's, for
vision-language folders), else its tokenizer's vocabulary."""

from __future__ import annotations

from typing import Any


def vocab_size(tokenizer: Any, config: dict) -> int:
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int):
            return cfg["vocab_size"]
    return len(tokenizer.vocab)
