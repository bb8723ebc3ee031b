"""Tenants: each API key of --api-key-file gets a prompt cache of its own (a prefix cached under
one key is never a hit under another), unless --shared-cache; a client's own `cache_salt`
separates further; CORS only for the origins named; --max-prompt-tokens is a clear 400."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from live_server import Live, openai_error, post, tiny_live_server

from rewind.config import ServerConfig
from rewind.server.auth import KeyRing

# 600 ids: two whole 256-token blocks to hit, on the tiny model's 512-id vocabulary.
PROMPT = [(7 * i) % 500 + 3 for i in range(600)]


def write_keys(folder: Path) -> Path:
    keys = folder / "keys.txt"
    keys.write_text("# tenants\nsk-alice alice\n\nsk-bob bob  # a comment\nsk-carol\n")
    return keys


def cached(live: Live, key: str, **extra) -> int:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    answer = post(live, "/v1/completions", body, headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_key_has_a_cache_of_its_own(tiny_model_path, tmp_path):
    with tiny_live_server(tiny_model_path("llama"), tmp_path,
                          api_key_file=write_keys(tmp_path)) as live:
        assert cached(live, "sk-alice") == 0
        assert cached(live, "sk-alice") >= 512  # the same tenant hits
        assert cached(live, "sk-bob") == 0  # another tenant does not, though RAM holds it
        assert cached(live, "sk-carol") == 0
        assert cached(live, "sk-alice") >= 512  # and the first one still hits
        assert cached(live, "sk-bob") >= 512
        # A client's own salt (vLLM's cache_salt) separates within one key too.
        assert cached(live, "sk-alice", cache_salt="project-x") == 0
        assert cached(live, "sk-alice", cache_salt="project-x") >= 512
        assert openai_error(post(live, "/v1/completions", {"prompt": "hi"},
                                 headers={"authorization": "Bearer sk-mallory"}), 401)
        assert openai_error(post(live, "/v1/completions", {"prompt": "hi"}), 401)


def test_shared_cache_lets_keys_hit_each_other(tiny_model_path, tmp_path):
    with tiny_live_server(tiny_model_path("llama"), tmp_path, api_key_file=write_keys(tmp_path),
                          shared_cache=True) as live:
        assert cached(live, "sk-alice") == 0
        assert cached(live, "sk-bob") >= 512


def test_key_files_are_checked(tmp_path):
    keys = write_keys(tmp_path)
    ring = KeyRing.from_file(keys)
    assert [(k.secret, k.name) for k in ring.keys] == [
        ("sk-alice", "alice"), ("sk-bob", "bob"), ("sk-carol", "key-5")]
    assert ring.match("sk-bob").name == "bob" and ring.match("sk-bo") is None
    assert ring.cache_salt(ring.keys[0]) != ring.cache_salt(ring.keys[1])
    for text, problem in (("", "no API key"), ("a b c\n", "got 3 words"),
                          ("same x\nsame y\n", "twice")):
        (tmp_path / "bad.txt").write_text(text)
        with pytest.raises(ValueError, match=problem):
            KeyRing.from_file(tmp_path / "bad.txt")


def test_cors_only_for_the_origins_named(tiny_model_path, tmp_path):
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type,authorization"}
    with tiny_live_server(tiny_model_path("llama"), tmp_path) as closed:
        answer = httpx.options(f"{closed.url}/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in answer.headers
    with tiny_live_server(tiny_model_path("llama"), tmp_path,
                          cors_origins=["https://app.example"]) as open_to_one:
        answer = httpx.options(f"{open_to_one.url}/v1/chat/completions", headers=preflight)
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(f"{open_to_one.url}/v1/chat/completions",
                              headers={**preflight, "origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_max_prompt_tokens_is_a_clear_400(tiny_model_path, tmp_path):
    with tiny_live_server(tiny_model_path("llama"), tmp_path, max_prompt_tokens=100) as live:
        error = openai_error(post(live, "/v1/completions", {"prompt": PROMPT}), 400)
        assert error["code"] == "prompt_too_long" and "600" in error["message"]
        assert post(live, "/v1/completions", {"prompt": PROMPT[:50],
                                              "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("setting", [{"max_tokens": 0}, {"body_idle_seconds": 0},
                                     {"max_prompt_tokens": 0}, {"port": 70000}])
def test_server_settings_are_validated(setting):
    with pytest.raises(ValueError):
        ServerConfig(**setting).validate()
