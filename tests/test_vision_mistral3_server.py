"""A tiny Mistral 3 through the live HTTP server and the real `openai` client: an image part
expands into rows of image tokens with [IMG_BREAK] between rows and [IMG_END] after them, its
repeat comes from the prompt cache with the same answer, and a streamed answer equals the plain
one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vision_helpers import answer, live_vision_server, streamed_answer, user_with_image

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import openai  # noqa: E402

from rewind.engine import Engine  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_vlm import IMG_BREAK, IMG_END, build_tiny_vlm_model  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str, Engine]]:
    folder = build_tiny_vlm_model(tmp_path_factory.mktemp("tiny-mistral3"), "mistral3")
    with live_vision_server(load_model(str(folder)), tmp_path_factory.mktemp("scratch")) as live:
        yield live


def test_openai_image_prompt_on_mistral3_and_its_repeat_from_the_cache(live, monkeypatch):
    client, model, engine = live
    seen = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit",
                        lambda request, **kw: seen.append(request) or submit(request, **kw))
    text_only = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is in this picture?"}], **GREEDY)
    first = client.chat.completions.create(model=model, messages=user_with_image(1), **GREEDY)
    second = client.chat.completions.create(model=model, messages=user_with_image(1), **GREEDY)
    # 320x240 fits 224 px as 224x168: 6 rows of 8 tokens, 5 row breaks, then [IMG_END]; the
    # placeholder [IMG] is the first image token.
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 6 * 8 + 5 + 1
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert answer(second) == answer(first) != ""
    tokens = seen[1].prompt_tokens
    assert tokens.count(engine.tokenizer.convert_tokens_to_ids(IMG_BREAK)) == 5
    assert tokens.count(engine.tokenizer.convert_tokens_to_ids(IMG_END)) == 1
    other = client.chat.completions.create(model=model, messages=user_with_image(2, (200, 330)),
                                           **GREEDY)
    # 200x330 fits as 135x224, 140x224 in whole tokens: 8 rows of 5.
    assert other.usage.prompt_tokens == text_only.usage.prompt_tokens + 8 * 5 + 7 + 1


def test_streamed_image_answer_equals_the_plain_one(live):
    client, model, _ = live
    plain = client.chat.completions.create(model=model, messages=user_with_image(3), **GREEDY)
    stream = client.chat.completions.create(model=model, messages=user_with_image(3), stream=True,
                                            **GREEDY)
    assert streamed_answer(stream) == answer(plain) != ""
