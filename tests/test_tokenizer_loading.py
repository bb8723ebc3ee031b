"""Rewind's tokenizer loader gives what mlx-lm's gives (it only avoids parsing tokenizer.json
twice): the same streaming detokenizer, end tokens, chat template, thinking tags, tool parser,
and the same ids and streamed text."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

from rewind.models.tokenizer_loading import load_tokenizer
from rewind.testing.tiny_models import FAMILIES

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n  # ünïcödé, 数字 🙂",
         "<think>why</think> the answer\n\n  spaced   out  "]


def streamed(tokenizer, ids: list[int]) -> list[str]:
    """The text the streaming detokenizer gives after each token."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    pieces = []
    for token in ids:
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    pieces.append(detokenizer.last_segment)
    return pieces


def assert_same_tokenizer(path: Path, eos_token_ids: list[int] | None) -> None:
    ours = load_tokenizer(path, eos_token_ids=eos_token_ids)
    theirs = mlx_lm_load_tokenizer(path, eos_token_ids=eos_token_ids)
    assert type(ours.detokenizer) is type(theirs.detokenizer)
    assert getattr(ours.detokenizer, "trim_space", None) == getattr(theirs.detokenizer,
                                                                     "trim_space", None)
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert ours.has_chat_template == theirs.has_chat_template
    assert (ours.think_start, ours.think_end) == (theirs.think_start, theirs.think_end)
    assert ours.has_tool_calling == theirs.has_tool_calling
    assert ours.tool_call_start == theirs.tool_call_start
    assert "get_vocab" not in vars(ours._tokenizer)  # the one-dict vocabulary was put back
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert streamed(ours, ids) == streamed(theirs, ids)
    if ours.has_chat_template:
        messages = [{"role": "user", "content": TEXTS[0]}]
        assert (ours.apply_chat_template(messages, add_generation_prompt=True)
                == theirs.apply_chat_template(messages, add_generation_prompt=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_same_tokenizer_as_mlx_lm_on_the_tiny_models(tiny_model_path, family: str) -> None:
    assert_same_tokenizer(tiny_model_path(family), None)


@pytest.mark.real_model
def test_same_tokenizer_as_mlx_lm_on_the_default_model() -> None:
    """A SentencePiece vocabulary of 262k words (its own streaming detokenizer)."""
    from rewind.models.registry import resolve_model

    path = resolve_model("default")
    ours = load_tokenizer(path)
    assert type(ours.detokenizer).__name__ == "SPMStreamingDetokenizer"
    assert_same_tokenizer(path, [1, 106])
