"""Images through the live HTTP server (uvicorn on loopback, the real engine, prompt cache and
tiny Gemma 3 vision model), spoken to by the `openai` and `anthropic` clients: image parts work
in each API, a repeated image prompt is served from the cache, and bad images get a 400 in each
API's own error shape."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import pytest
from live_server import Live, start_server

pytest.importorskip("mlx_vlm")
pytest.importorskip("PIL")
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from rewind.cache.prompt_cache import PromptCache  # noqa: E402
from rewind.config import CacheConfig, EngineConfig, ServerConfig  # noqa: E402
from rewind.engine import Engine  # noqa: E402
from rewind.models.loader import load_model  # noqa: E402
from rewind.server.app import create_app  # noqa: E402
from rewind.testing.tiny_vision import IMAGE_TOKENS, build_tiny_vision_model  # noqa: E402
from rewind.vision.images import MAX_IMAGES_PER_REQUEST  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 4}


def png_base64(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def image_part(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_base64(seed)}"}}


def user_with(*parts: dict, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    folder = build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vision"))
    loaded = load_model(str(folder))
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, CacheConfig(
        cache_dir=tmp_path_factory.mktemp("scratch"), disk_bytes=64 << 20))
    engine = Engine(loaded, EngineConfig(parallel=2), prompt_cache).start()
    server = start_server(create_app(loaded, engine, ServerConfig(), prompt_cache), engine,
                          loaded)
    yield server
    server.stop()
    engine.shutdown()
    prompt_cache.close()


def test_openai_image_prompt_and_its_repeat_from_the_cache(live: Live):
    client = live.openai()
    messages = user_with(image_part(1))
    first = client.chat.completions.create(model=live.model, messages=messages, **GREEDY)
    second = client.chat.completions.create(model=live.model, messages=messages, **GREEDY)
    text_only = client.chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "What is in this picture?"}],
        **GREEDY)
    assert first.usage.prompt_tokens >= text_only.usage.prompt_tokens + IMAGE_TOKENS + 2
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content


def test_anthropic_image_block_gives_the_same_prompt_as_openai(live: Live):
    data = png_base64(2)
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": data}}]
    with httpx.Client(base_url=live.url, timeout=60) as http:  # this client version has no
        raw = http.post("/v1/messages", json={  # temperature argument: greedy through httpx
            "model": live.model, "max_tokens": 4, "temperature": 0.0,
            "messages": [{"role": "user", "content": content}]})
    assert raw.status_code == 200, raw.text
    reply = raw.json()
    same = live.openai().chat.completions.create(  # Anthropic joins text blocks with "\n"
        model=live.model, messages=user_with({"type": "image_url", "image_url": {
            "url": f"data:image/png;base64,{data}"}}, text="What is in this picture?\n"),
        **GREEDY)
    assert reply["usage"]["input_tokens"] == same.usage.prompt_tokens
    assert reply["usage"]["output_tokens"] == same.usage.completion_tokens == 4
    counted = live.anthropic().messages.count_tokens(
        model=live.model, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == same.usage.prompt_tokens
    # The same tokens and the same image hash: the OpenAI request restores what Anthropic's made.
    assert same.usage.prompt_tokens_details.cached_tokens == same.usage.prompt_tokens - 1


def test_responses_input_image(live: Live):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        reply = http.post("/v1/responses", json={
            "model": live.model, "max_output_tokens": 3, "temperature": 0.0,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "Describe"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{png_base64(3)}"}]}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["input_tokens"] > IMAGE_TOKENS


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,AAAAbm90IGFuIGltYWdl", "could not be decoded"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "--allow-image-urls"),
])
def test_bad_openai_images_are_400s_in_openai_shape(live: Live, url: str, message: str):
    client = live.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=live.model, messages=user_with(
            {"type": "image_url", "image_url": {"url": url}}), **GREEDY)
    error = caught.value.body
    assert message in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_image"


def test_too_many_images_is_a_400(live: Live):
    parts = [image_part(seed) for seed in range(MAX_IMAGES_PER_REQUEST + 1)]
    with pytest.raises(openai.BadRequestError, match="too many images"):
        live.openai().chat.completions.create(model=live.model, messages=user_with(*parts),
                                              **GREEDY)


def test_bad_anthropic_image_is_a_400_in_anthropic_shape(live: Live):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        reply = http.post("/v1/messages", json={
            "model": live.model, "max_tokens": 3, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(b"garbage").decode()}}]}]})
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "could not be decoded" in body["error"]["message"]
    # The server goes on serving.
    ok = live.anthropic().messages.create(model=live.model, max_tokens=2,
                                          messages=[{"role": "user", "content": "hello"}])
    assert ok.stop_reason in ("max_tokens", "end_turn")


def test_images_on_a_text_model_are_refused(tiny_model_path, tmp_path):
    loaded = load_model(str(tiny_model_path("llama")))
    engine = Engine(loaded, EngineConfig(parallel=1)).start()
    server = start_server(create_app(loaded, engine, ServerConfig()), engine, loaded)
    try:
        with pytest.raises(openai.BadRequestError, match="does not accept images"):
            server.openai().chat.completions.create(model=server.model,
                                                    messages=user_with(image_part(1)), **GREEDY)
    finally:
        server.stop()
        engine.shutdown()


def test_allow_image_urls_flag_reaches_the_server_config():
    import argparse

    from rewind.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert not serve.server_config(parser.parse_args(["serve"])).allow_image_urls
    assert serve.server_config(parser.parse_args(["serve", "--allow-image-urls"])).allow_image_urls
