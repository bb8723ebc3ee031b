"""POST /v1/models/pull on a real `rewind serve` subprocess, downloading from a hub on loopback
(tests/fake_hub.py) with huggingface_hub itself: progress events arrive, the model is then
listed and answers a chat; a repo the hub does not have and a hub that cannot be reached end
the stream with a clean error event; keys decide who may pull."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fake_hub import fake_hub
from serve_subprocess import rewind_serve

pytestmark = pytest.mark.slow  # a fresh interpreter imports mlx, mlx-lm and transformers
REPO = "tiny-org/tiny-gemma3"


def pull_events(url: str, body: dict[str, Any], key: str | None = None
                ) -> tuple[httpx.Response, list[tuple[str, dict[str, Any]]]]:
    """The pull's answer and its (event name, data) pairs, checking each data's `type`."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", f"{url}/v1/models/pull", json=body, headers=headers,
                      timeout=120) as response:
        if response.status_code != 200:
            response.read()
            return response, events
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return response, events


def chat(url: str, model: str, key: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_pull_streams_progress_then_serves_the_model(tiny_model_path, tmp_path):
    with fake_hub(chunk_delay=0.002) as (hub_url, hub):
        hub.add(REPO, tiny_model_path("gemma3"))
        files = {file.name: file.stat().st_size for file in tiny_model_path("gemma3").iterdir()}
        with rewind_serve(tiny_model_path("llama"), tmp_path, hub_url) as url:
            listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
            assert REPO not in [model["id"] for model in listed]

            response, events = pull_events(url, {"model": REPO})
            assert response.status_code == 200, response.text
            names = [name for name, _ in events]
            assert names[-1] == "done" and "error" not in names, events
            progress = [data for name, data in events if name == "progress"]
            assert len(progress) >= 2
            # Bytes per file and overall, never going back, ending with every file whole.
            overall = [data["done"] for data in progress]
            assert overall == sorted(overall) and overall[0] < progress[-1]["total"]
            last = progress[-1]
            assert {f["name"]: f["total"] for f in last["files"]} == files
            assert all(f["done"] == f["total"] for f in last["files"])
            assert last["done"] == last["total"] == sum(files.values())
            done = events[-1][1]
            assert done["model"] == REPO and done["form"] == "f32"
            assert done["size_bytes"] == sum(files.values())

            listed = {model["id"]: model for model in
                      httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
            assert listed[REPO]["kind"] == "hf" and not listed[REPO]["loaded"]
            answer = chat(url, REPO)
            assert answer["model"] == REPO and answer["usage"]["completion_tokens"] > 0

            # A second pull finds every file cached: nothing is fetched again.
            before = sum(1 for request in hub.requests if request.startswith("GET /tiny-org"))
            _, again = pull_events(url, {"model": REPO})
            assert again[-1][0] == "done"
            assert sum(1 for r in hub.requests if r.startswith("GET /tiny-org")) == before

            # A repo the hub does not have: a clean error event, nothing listed.
            response, events = pull_events(url, {"model": "tiny-org/not-there"})
            assert response.status_code == 200
            [(name, data)] = [event for event in events if event[0] != "progress"]
            assert name == "error" and "no repo 'tiny-org/not-there'" in data["error"]["message"]
            assert "Traceback" not in data["error"]["message"]

            # Not ORG/NAME: refused before any stream, in the API's error shape.
            response, _ = pull_events(url, {"model": "no-slash"})
            assert response.status_code == 400
            assert "not a Hugging Face repo id" in response.json()["error"]["message"]
            response, _ = pull_events(url, {"model": "a/b/c"})
            assert response.status_code == 400

            # The route and its body are in the OpenAPI document, `model` open to any repo.
            document = httpx.get(f"{url}/openapi.json", timeout=30).json()
            assert "post" in document["paths"]["/v1/models/pull"]
            schema = document["components"]["schemas"]["PullRequest"]["properties"]["model"]
            assert schema["type"] == "string" and "enum" not in json.dumps(schema)


def test_an_unreachable_hub_is_a_clean_error_event(tiny_model_path, tmp_path):
    # Nothing listens on port 9: connections are refused at once, as with no network.
    with rewind_serve(tiny_model_path("llama"), tmp_path, "http://127.0.0.1:9") as url:
        response, events = pull_events(url, {"model": REPO})
        assert response.status_code == 200
        assert events[-1][0] == "error"
        message = events[-1][1]["error"]["message"]
        assert "not reachable" in message and "HF_ENDPOINT" in message


def test_only_the_admin_key_pulls_when_keys_come_from_a_file(tiny_model_path, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alice alice\n")
    with fake_hub() as (hub_url, hub):
        hub.add(REPO, tiny_model_path("gemma3"))
        with rewind_serve(tiny_model_path("llama"), tmp_path, hub_url,
                          "--api-key-file", str(keys), "--admin-key", "sk-admin") as url:
            response, _ = pull_events(url, {"model": REPO})
            assert response.status_code == 401
            response, _ = pull_events(url, {"model": REPO}, key="sk-alice")
            assert response.status_code == 403
            error = response.json()["error"]
            assert error["type"] == "permission_error" and "--admin-key" in error["message"]
            assert not any("/resolve/" in request for request in hub.requests)
            _, events = pull_events(url, {"model": REPO}, key="sk-admin")
            assert events[-1][0] == "done"
            # A tenant may use what the admin pulled.
            assert chat(url, REPO, key="sk-alice")["model"] == REPO


def test_who_may_pull_follows_the_keys(tmp_path):
    from rewind.config import ServerConfig
    from rewind.server.auth import key_ring

    keys = tmp_path / "keys.txt"
    keys.write_text("sk-alice alice\n")
    [lone] = key_ring(ServerConfig(api_key="sk-one")).keys
    assert lone.operator  # the server's one user
    ring = key_ring(ServerConfig(api_key="sk-one", api_key_file=keys, admin_key="sk-admin"))
    assert {key.secret: key.operator for key in ring.keys} == {
        "sk-one": False, "sk-alice": False, "sk-admin": True}
