"""The load-time warm-up (rewind.engine.warm_up): real requests through an engine of their own,
leaving nothing behind (no thread, no prompt cache records)."""

from __future__ import annotations

import threading

import pytest

from rewind.config import CacheConfig, EngineConfig
from rewind.engine.warm_up import DECODE_TOKENS, PROMPT_LENGTHS, warm_up, warm_up_prompt


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_warm_up_generates_through_its_own_engine_and_stops_it(tiny_loaded, family: str) -> None:
    loaded = tiny_loaded(family)
    engines_before = {t for t in threading.enumerate() if t.name == "rewind-engine"}
    done = warm_up(loaded, EngineConfig())
    assert done.seconds > 0
    assert len(PROMPT_LENGTHS) <= done.generated <= len(PROMPT_LENGTHS) * DECODE_TOKENS
    assert done.cached_tokens == 0  # no prompt cache, no cached turn
    engines_after = {t for t in threading.enumerate() if t.name == "rewind-engine" and t.is_alive()}
    assert engines_after <= engines_before


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_warm_up_runs_a_cached_turn_where_the_server_caches_prompts(
        tiny_loaded, family: str, tmp_path) -> None:
    """The third request restores the first prompt's last point but one (299 of 300 tokens),
    through a cache of the warm-up's own: nothing reaches the server's folder."""
    loaded = tiny_loaded(family)
    server_cache = CacheConfig(cache_dir=tmp_path / "cache", persist=True)
    done = warm_up(loaded, EngineConfig(), server_cache)
    assert done.cached_tokens == PROMPT_LENGTHS[0] - 1
    assert len(PROMPT_LENGTHS) + 1 <= done.generated <= (len(PROMPT_LENGTHS) + 1) * DECODE_TOKENS
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert warm_up(loaded, EngineConfig(), CacheConfig(enabled=False)).cached_tokens == 0


def test_warm_up_prompt_is_ordinary_text_of_the_asked_length(tiny_loaded) -> None:
    tokenizer = tiny_loaded("llama").tokenizer
    prompt = warm_up_prompt(tokenizer, 300)
    assert len(prompt) == 300
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    assert not special & set(prompt)


def test_warm_up_runs_on_the_model_thread_it_is_given(tiny_loaded) -> None:
    """With the model's thread, the warm-up's engine runs there (no thread of its own), and the
    thread stays for the serving engine."""
    from rewind.engine.model_thread import ModelThread

    class Counted(ModelThread):
        """The real thread, counting what is handed to it."""

        submitted = 0

        def submit(self, call):
            self.submitted += 1
            return super().submit(call)

    thread = Counted("rewind-test-warm-up")
    try:
        done = warm_up(tiny_loaded("llama"), EngineConfig(), thread=thread)
        assert done.generated >= len(PROMPT_LENGTHS)
        assert thread.submitted == 2  # the warm-up engine's loop, then the longer contexts
        assert thread.run(lambda: threading.current_thread().name, timeout=10) \
            == "rewind-test-warm-up"
    finally:
        thread.close()
