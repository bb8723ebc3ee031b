"""The tiny model factory: deterministic, loadable, generates varied text, right cache classes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from rewind.testing.tiny_models import build_tiny_model

EXPECTED_CACHES = {
    "llama": {KVCache},
    "gemma3": {KVCache, RotatingKVCache},
    "qwen3_5": {KVCache, ArraysCache},
}


def _digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def _greedy(loaded, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n)
    return [int(token) for token, _ in steps]


def test_cache_classes(tiny_loaded, tiny_family):
    cache = make_prompt_cache(tiny_loaded(tiny_family).model)
    assert {type(c) for c in cache} == EXPECTED_CACHES[tiny_family]


def test_gemma3_window_is_small():
    from rewind.testing.tiny_models import _family_config

    config = _family_config("gemma3")
    assert config["sliding_window"] == 64
    assert config["num_hidden_layers"] > config["sliding_window_pattern"]


def test_build_is_deterministic(tiny_model_path, tmp_path, tiny_family):
    again = build_tiny_model(tiny_family, tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_path(tiny_family))


def test_greedy_output_varies_and_depends_on_prompt(tiny_loaded, tiny_family):
    loaded = tiny_loaded(tiny_family)
    tokenizer = loaded.tokenizer
    first = _greedy(loaded, tokenizer.encode("The weather in Berlin is"), 24)
    second = _greedy(loaded, tokenizer.encode("def fibonacci(n):"), 24)
    assert len(set(first)) >= 6, first  # not one token repeated
    assert first != second


def test_long_prompt_crosses_the_window(tiny_loaded, tiny_family):
    """A prompt longer than the sliding window runs and gives finite logits."""
    loaded = tiny_loaded(tiny_family)
    tokens = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    assert len(tokens) > 128
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array(tokens)[None], cache=cache)
    assert bool(mx.all(mx.isfinite(logits)).item())
    for layer_cache in cache:
        if isinstance(layer_cache, (KVCache, RotatingKVCache)):
            assert layer_cache.offset == len(tokens)


def test_tokenizer_and_chat_template(tiny_loaded):
    tokenizer = tiny_loaded("llama").tokenizer
    text = "Hello! How can I help you today?"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode(text)[0] == tokenizer.bos_token_id
    assert tokenizer.has_thinking and tokenizer.think_start == "<think>"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning_content": "old thought"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok", "reasoning_content": "new thought"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "old thought" not in rendered  # reasoning before the last user turn is dropped
    assert "<think>\nnew thought\n</think>\n\nok<|im_end|>" in rendered
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids


def test_unknown_family_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="llama, gemma3, qwen3_5"):
        build_tiny_model("mamba", tmp_path)
