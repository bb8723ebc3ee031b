"""A tiny Qwen2.5-VL and a tiny Qwen3-VL through the live HTTP server and the real `openai`
client: an image prompt expands into its grid of image tokens, its repeat comes from the prompt
cache with the same answer, the engine gets the 3-D positions (and Qwen3-VL's deepstack
features), and text requests keep working."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vision_helpers import answer, live_vision_server, streamed_answer, user_with_image

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import numpy as np  # noqa: E402
import openai  # noqa: E402

from rewind.engine import Engine  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.testing.tiny_qwen_vl import build_tiny_qwen_vl_model  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def live(model_type, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str, Engine]]:
    folder = build_tiny_qwen_vl_model(tmp_path_factory.mktemp(f"tiny-{model_type}"), model_type)
    with live_vision_server(load_model(str(folder)), tmp_path_factory.mktemp("scratch")) as live:
        yield live


def test_openai_image_prompt_on_qwen_vl_and_its_repeat_from_the_cache(live):
    client, model, _ = live
    text_only = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is in this picture?"}], **GREEDY)
    first = client.chat.completions.create(model=model, messages=user_with_image(1), **GREEDY)
    second = client.chat.completions.create(model=model, messages=user_with_image(1), **GREEDY)
    # A 320x240 image: a 6x9 grid of image tokens between <|vision_start|> and <|vision_end|>.
    assert first.usage.prompt_tokens == text_only.usage.prompt_tokens + 54 + 2
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert answer(second) == answer(first) != ""
    other = client.chat.completions.create(model=model, messages=user_with_image(2, (200, 330)),
                                           **GREEDY)
    assert other.usage.prompt_tokens == text_only.usage.prompt_tokens + 60 + 2  # a 10x6 grid


def test_the_server_hands_the_engine_3d_positions(live, model_type, monkeypatch):
    client, model, engine = live
    seen = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit",
                        lambda request, **kw: seen.append(request) or submit(request, **kw))
    client.chat.completions.create(model=model, messages=user_with_image(4), **GREEDY)
    (request,) = seen
    rows = np.array(request.positions(0, len(request.prompt_tokens)))[:, 0]
    assert len({tuple(row) for row in rows}) == 3  # t, h and w differ inside the image
    assert request.position_delta == int(rows.max()) + 1 - len(request.prompt_tokens) < 0
    if model_type == "qwen3_vl":  # its deepstack features, for layers 0-2
        added = request.layer_residuals(0, len(request.prompt_tokens))
        assert sorted(added) == [0, 1, 2]
    else:
        assert request.layer_residuals is None


def test_streamed_image_answer_equals_the_plain_one(live):
    client, model, _ = live
    plain = client.chat.completions.create(model=model, messages=user_with_image(3), **GREEDY)
    stream = client.chat.completions.create(model=model, messages=user_with_image(3), stream=True,
                                            **GREEDY)
    assert streamed_answer(stream) == answer(plain) != ""
