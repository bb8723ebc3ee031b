"""`rewind chat`: driven through stdin, and the cache reuse across turns never changes a reply."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

import pytest

from rewind.commands.chat import ChatSession, split_reasoning
from rewind.commands.common import ReplyStats, new_cache, stream_reply
from rewind.config import CacheConfig

TURNS = ["What is the weather in Berlin today? " * 3, "And tomorrow, will it be sunny?",
         "Please think step by step, then answer briefly."]


def chat_args(**overrides) -> argparse.Namespace:
    values = dict(system="You are terse.", no_think=False, max_tokens=24, temp=0.0, top_p=1.0,
                  top_k=0, min_p=0.0, seed=None, max_kv_size=None)
    values.update(overrides)
    return argparse.Namespace(**values)


def fresh_reply(loaded, tokens: list[int], max_tokens: int) -> str:
    """The reply to `tokens` computed from nothing: no live cache, no prompt cache."""
    from rewind.engine import SamplingParams

    cache = new_cache(loaded.model, None, None)
    return "".join(stream_reply(loaded.model, loaded.tokenizer, tokens, cache,
                                SamplingParams(temperature=0.0), max_tokens, ReplyStats()))


@pytest.mark.parametrize("use_prompt_cache", [True, False])
def test_every_turn_equals_a_fresh_computation(tiny_loaded, tiny_family, use_prompt_cache):
    from rewind.cache import PromptCache

    loaded = tiny_loaded(tiny_family)
    prompt_cache = (PromptCache(loaded.model, loaded.fingerprint,
                                CacheConfig(ram_bytes=64 << 20, disk_enabled=False))
                    if use_prompt_cache else None)
    session = ChatSession(loaded, chat_args(), prompt_cache)
    try:
        cached_by_turn = []
        for text in TURNS:
            out = io.StringIO()
            stats = session.turn(text, out)
            cached_by_turn.append(stats.cached_tokens)
            # The prompt this turn saw: the conversation up to its user message.
            tokens = list(loaded.tokenizer.apply_chat_template(
                session.messages[:-1], add_generation_prompt=True, enable_thinking=True))
            assert out.getvalue() == fresh_reply(loaded, tokens, 24) + "\n"
    finally:
        if prompt_cache is not None:
            prompt_cache.close()
    assert cached_by_turn[0] == 0
    if use_prompt_cache or tiny_family == "llama":
        # Restored from a checkpoint or trimmed: at least the first turn's user message.
        assert all(n >= 20 for n in cached_by_turn[1:]), cached_by_turn


def test_reset_forgets_the_conversation(tiny_loaded):
    session = ChatSession(tiny_loaded("llama"), chat_args(system=None), None)
    session.turn("Hello", io.StringIO())
    session.reset()
    assert session.messages == [] and session.fed == [] and session.cache is None


def test_two_turns_through_stdin(tiny_model_path):
    stdin = "Hello! How can I help you today?\n/help\nWhat is two plus two?\n/exit\nnever read\n"
    out = subprocess.run(
        [sys.executable, "-m", "rewind", "chat", "--model", str(tiny_model_path("gemma3")),
         "--max-tokens", "12", "--verbose", "--no-disk-cache"],
        input=stdin, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("Prompt:") == 2  # one report per turn, none after /exit
    assert "(+" in out.stderr.split("Prompt:")[2]  # turn two reused the cache
    assert "/reset" in out.stderr  # /help printed the commands
    assert "Traceback" not in out.stderr


def test_unknown_model_is_a_clean_error(capsys, tmp_path):
    from rewind.cli import build_parser

    args = build_parser().parse_args(["chat", "--model", str(tmp_path / "absent")])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "absent" in err and err.startswith("rewind: error:")


@pytest.mark.parametrize(("reply", "opened", "expected"), [
    ("plan it</think>\n\nThe answer.", True, ("plan it", "The answer.")),
    ("still thinking", True, ("still thinking", "")),
    ("<think>hmm</think> Yes.", False, ("hmm", "Yes.")),
    ("Just an answer.", False, ("", "Just an answer.")),
])
def test_split_reasoning(reply, opened, expected):
    assert split_reasoning(reply, opened) == expected
