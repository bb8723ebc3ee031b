"""A real uvicorn server on a free loopback port, in a background thread, for live-server tests."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
import threading
import time
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import uvicorn


def serve_on_free_port(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Start `app`; returns its base URL, the server (set `should_exit` to stop) and its thread."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "the server did not start"
    return f"http://127.0.0.1:{port}", server, thread


@dataclass
class Live:
    url: str
    engine: Any
    loaded: Any
    model: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"),
                             timeout=60, max_retries=0, **kwargs)

    def anthropic(self, **kwargs: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=kwargs.pop("api_key", "unused"),
                                   timeout=60, max_retries=0, **kwargs)


def start_server(app: Any, engine: Any, loaded: Any) -> Live:
    url, server, thread = serve_on_free_port(app)
    return Live(url, engine, loaded, str(loaded.name), server, thread)


def post(live: Live, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{live.url}{path}", content=content, headers=headers, timeout=30,
                      **kwargs)


def greedy_completion(url: str, prompt: list[int], tokens: int = 6) -> tuple[list[str], int]:
    """(the greedy answer's tokens, the prompt tokens served from the cache) of a completion."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    return (data["choices"][0]["logprobs"]["tokens"],
            data["usage"]["prompt_tokens_details"]["cached_tokens"])


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    return body["error"]


@contextmanager
def tiny_live_server(folder: Path, scratch: Path, cache: dict[str, Any] | None = None,
                     **server_config: Any) -> Iterator[Live]:
    """The real engine and prompt cache (RAM + a 64 MiB disk tier) on a tiny model folder, served
    on loopback; `cache` sets CacheConfig fields, `server_config` ServerConfig fields."""
    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig, ServerConfig
    from rewind.engine import Engine
    from rewind.models.loader import load_model
    from rewind.server.app import create_app

    loaded = load_model(str(folder))
    cache_config = CacheConfig(**{"cache_dir": scratch, "disk_bytes": 64 << 20, **(cache or {})})
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, cache_config)
    engine = Engine(loaded, EngineConfig(parallel=4, max_queue=64, cache=cache_config),
                    prompt_cache).start()
    config = ServerConfig(model=str(loaded.name), **server_config)
    server = start_server(create_app(loaded, engine, config, prompt_cache), engine, loaded)
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()
        prompt_cache.close()
