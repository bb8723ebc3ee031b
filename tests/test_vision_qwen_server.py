"""A tiny Qwen2.5-VL through the live HTTP server and the real `openai` client: an image prompt
expands into its grid of image tokens, its repeat comes from the prompt cache with the same
answer as the engine gives for the same prompt, and text requests keep working."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import pytest
from live_server import serve_on_free_port

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import numpy as np  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from rewind.cache.prompt_cache import PromptCache  # noqa: E402
from rewind.config import CacheConfig, EngineConfig, ServerConfig  # noqa: E402
from rewind.engine import Engine  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.server.app import create_app  # noqa: E402
from rewind.testing.tiny_qwen_vl import build_tiny_qwen_vl_model  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 6}


def png_base64(seed: int, size: tuple[int, int]) -> str:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def user_with_image(seed: int, size: tuple[int, int] = (320, 240)) -> list[dict]:
    url = f"data:image/png;base64,{png_base64(seed, size)}"
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def answer(completion) -> str:
    """The whole answer text: the tiny tokenizer's chat template has <think> tags, so a random
    model's text may come back as reasoning_content."""
    message = completion.choices[0].message
    return (getattr(message, "reasoning_content", None) or "") + (message.content or "")


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str, Engine]]:
    folder = build_tiny_qwen_vl_model(tmp_path_factory.mktemp("tiny-qwen-vl"))
    loaded = load_model(str(folder))
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(
        cache_dir=tmp_path_factory.mktemp("scratch"), disk_bytes=64 << 20))
    engine = Engine(loaded, EngineConfig(parallel=2), prompt_cache).start()
    url, server, thread = serve_on_free_port(create_app(loaded, engine, ServerConfig(),
                                                        prompt_cache))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    yield client, str(loaded.name), engine
    server.should_exit = True
    thread.join(10)
    engine.shutdown()
    prompt_cache.close()


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


def test_the_server_hands_the_engine_3d_positions(live, monkeypatch):
    client, model, engine = live
    seen = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request: seen.append(request) or submit(request))
    client.chat.completions.create(model=model, messages=user_with_image(4), **GREEDY)
    (request,) = seen
    rows = np.array(request.positions(0, len(request.prompt_tokens)))[:, 0]
    assert len({tuple(row) for row in rows}) == 3  # t, h and w differ inside the image
    assert request.position_delta == int(rows.max()) + 1 - len(request.prompt_tokens) < 0


def test_streamed_image_answer_equals_the_plain_one(live):
    client, model, _ = live
    plain = client.chat.completions.create(model=model, messages=user_with_image(3), **GREEDY)
    stream = client.chat.completions.create(model=model, messages=user_with_image(3), stream=True,
                                            **GREEDY)
    text = "".join((getattr(chunk.choices[0].delta, "reasoning_content", None) or "")
                   + (chunk.choices[0].delta.content or "") for chunk in stream if chunk.choices)
    assert text == answer(plain) != ""
