"""The load-time warm-up (rewind.engine.warm_up): real requests through an engine of their own,
leaving nothing behind (no thread, no prompt cache records)."""

from __future__ import annotations

import threading

import pytest

from rewind.config import EngineConfig
from rewind.engine.warm_up import DECODE_TOKENS, PROMPT_LENGTHS, warm_up, warm_up_prompt


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_warm_up_generates_through_its_own_engine_and_stops_it(tiny_loaded, family: str) -> None:
    loaded = tiny_loaded(family)
    engines_before = {t for t in threading.enumerate() if t.name == "rewind-engine"}
    seconds, generated = warm_up(loaded, EngineConfig())
    assert seconds > 0
    assert len(PROMPT_LENGTHS) <= generated <= len(PROMPT_LENGTHS) * DECODE_TOKENS
    engines_after = {t for t in threading.enumerate() if t.name == "rewind-engine" and t.is_alive()}
    assert engines_after <= engines_before


def test_warm_up_prompt_is_ordinary_text_of_the_asked_length(tiny_loaded) -> None:
    tokenizer = tiny_loaded("llama").tokenizer
    prompt = warm_up_prompt(tokenizer, 300)
    assert len(prompt) == 300
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    assert not special & set(prompt)
