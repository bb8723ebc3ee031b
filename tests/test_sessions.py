"""Client sessions as the web page shows them (/v1/rewind/sessions, /v1/rewind/status): grouped
by the prompt cache's prefix chain or an agent's session header, each API key seeing only its
own (an admin key sees all), bounded; and the page's own files with their security headers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Live, openai_error, tiny_live_server

from rewind.engine import Usage
from rewind.server.sessions import SessionBook

# ---------------------------------------------------------------- the session book alone

SYSTEM = list(range(3, 303))  # 300 tokens: a whole block and a partial one


def begin(book: SessionBook, tokens: list[int], checkpoints: list[int], tenant: str = "t",
          headers: dict[str, str] | None = None) -> str:
    return book.begin(tenant=tenant, salt="", model="m", api="chat", tokens=tokens,
                      checkpoints=checkpoints, headers=headers or {}).session_id


def test_a_conversation_that_grows_is_one_session():
    book = SessionBook()
    first = SYSTEM + [7, 8, 9]
    one = begin(book, first + [1, 2], [len(first), len(first) + 2])
    # The next turn repeats the first user message and adds the answer and a new question.
    two = begin(book, first + [1, 2, 50, 51, 52, 1, 2], [len(first) + 5, len(first) + 7])
    assert two == one
    # The same agent's other conversation: the same system prompt, another first message.
    other = begin(book, SYSTEM + [7, 8, 10, 1, 2], [len(first), len(first) + 2])
    assert other != one
    # Regenerating the first answer, or editing a later message, stays in the session.
    assert begin(book, first + [1, 2, 60, 61, 1, 2], [len(first) + 4, len(first) + 6]) == one
    assert [s.id for s in book.visible("t", admin=False)] == [one, other]  # most recent first


def test_turns_record_where_the_prompt_came_from():
    book = SessionBook()
    start = book.begin(tenant="t", salt="", model="m", api="chat", tokens=SYSTEM, checkpoints=[290],
                       headers={})
    book.finish(start, "stop", Usage(prompt_tokens=300, completion_tokens=5, cached_tokens=256,
                                     cached_ram_tokens=200, cached_disk_tokens=56,
                                     ttft_seconds=0.25))
    [session] = book.visible("t", admin=False)
    [turn] = session.turns
    assert (turn.ram_tokens, turn.disk_tokens, turn.recomputed_tokens) == (200, 56, 44)
    assert turn.checkpoints == (256, 290, 300)  # the block boundary, the turn end, the prompt end
    assert session.totals["recomputed_tokens"] == 44 and session.turn_count == 1
    assert turn.ttft_seconds == 0.25


def test_tenants_never_share_a_session():
    book = SessionBook()
    alice = begin(book, SYSTEM, [250], tenant="alice")
    bob = begin(book, SYSTEM, [250], tenant="bob")
    assert alice != bob
    assert [s.id for s in book.visible("alice", admin=False)] == [alice]
    assert [s.id for s in book.visible("bob", admin=False)] == [bob]
    assert {s.id for s in book.visible("carol", admin=True)} == {alice, bob}
    # A session header is the tenant's own too.
    named = {"x-claude-code-session-id": "abc"}
    assert begin(book, [1, 2], [2], "alice", named) != begin(book, [1, 2], [2], "bob", named)
    assert begin(book, [9, 9, 9], [3], "alice", named) == begin(book, [1, 2], [2], "alice", named)


def test_the_book_is_bounded():
    book = SessionBook(max_sessions=3)
    ids = [begin(book, [100 + i] * 10, [5]) for i in range(5)]
    assert [s.id for s in book.visible("t", admin=False)] == ids[:1:-1]
    # A dropped session's prefix starts a new one; what is kept still groups.
    assert begin(book, [104] * 12, [6]) == ids[4]
    assert len(book._anchors) <= 3 and sum(map(len, book._anchors.values())) == 3
    with pytest.raises(ValueError, match="at least 1"):
        SessionBook(max_sessions=0)


# ---------------------------------------------------------------- on a live server


def write_keys(folder: Path) -> Path:
    keys = folder / "keys.txt"
    keys.write_text("sk-alice alice\nsk-bob bob\n")
    return keys


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(live: Live, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": live.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    answer = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=auth(key),
                        timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def sessions(live: Live, key: str) -> dict[str, Any]:
    answer = httpx.get(f"{live.url}/v1/rewind/sessions", headers=auth(key), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.fixture(scope="module")
def keyed(tiny_model_path, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("sessions")
    with tiny_live_server(tiny_model_path("llama"), scratch, api_key_file=write_keys(scratch),
                          admin_key="sk-admin") as live:
        yield live


def test_each_key_sees_only_its_own_sessions(keyed):
    question = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    first = chat(keyed, "sk-alice", question)
    answer = first["choices"][0]["message"]["content"] or "red"
    follow_up = question + [{"role": "assistant", "content": answer},
                            {"role": "user", "content": "And two more?"}]
    second = chat(keyed, "sk-alice", follow_up)
    chat(keyed, "sk-bob", question)  # the same words under another key: another session

    mine = sessions(keyed, "sk-alice")
    assert mine["admin"] is False
    [session] = mine["data"]
    assert session["turn_count"] == 2 and session["source"] == "prefix"
    turns = session["turns"]
    for turn, usage in zip(turns, (first["usage"], second["usage"])):
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert turn["prompt_tokens"] == usage["prompt_tokens"]
        assert turn["ram_tokens"] + turn["disk_tokens"] == cached
        assert turn["recomputed_tokens"] == usage["prompt_tokens"] - cached
        assert turn["checkpoints"][-1] == usage["prompt_tokens"]
    assert turns[1]["ram_tokens"] > 0  # the second turn reused the first one's prefix

    [theirs] = sessions(keyed, "sk-bob")["data"]
    assert theirs["id"] != session["id"] and theirs["turn_count"] == 1
    every = sessions(keyed, "sk-admin")
    assert every["admin"] is True
    assert {s["id"] for s in every["data"]} == {session["id"], theirs["id"]}
    assert session["tenant"] != theirs["tenant"]


def test_the_page_data_needs_a_key(keyed):
    for path in ("/v1/rewind/sessions", "/v1/rewind/status"):
        assert openai_error(httpx.get(f"{keyed.url}{path}", timeout=30), 401)
        assert openai_error(httpx.get(f"{keyed.url}{path}", headers=auth("sk-mallory"),
                                      timeout=30), 401)
    settings = httpx.get(f"{keyed.url}/ui/settings.json", timeout=30).json()
    assert settings == {"auth_required": True}


def test_the_status_matches_the_metrics(keyed):
    chat(keyed, "sk-bob", [{"role": "user", "content": "Status, please."}])
    status = httpx.get(f"{keyed.url}/v1/rewind/status", headers=auth("sk-bob"), timeout=30)
    assert status.status_code == 200, status.text
    data = status.json()
    assert data["requests"]["parallel"] == 4 and data["requests"]["running"] == 0
    assert data["memory"]["budget_bytes"] > 0
    [model] = data["models"]
    assert model["loaded"] is True and model["id"] == keyed.model
    cache = data["cache"]
    assert cache["enabled"] and cache["ram"]["bytes"] > 0 and cache["disk"] is not None
    metrics = httpx.get(f"{keyed.url}/metrics", timeout=30).text
    from_ram = _sample(metrics, 'rewind_cached_prompt_tokens_total{tier="ram"}')
    from_disk = _sample(metrics, 'rewind_cached_prompt_tokens_total{tier="disk"}')
    assert cache["tokens_restored_ram"] == from_ram and cache["tokens_restored_disk"] == from_disk
    prompt = _sample(metrics, "rewind_prompt_tokens_total")
    assert cache["tokens_requested"] == prompt
    assert cache["tokens_recomputed"] == prompt - from_ram - from_disk
    assert 0 < cache["hit_rate"] < 1


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_openapi_describes_the_page_data(keyed):
    document = httpx.get(f"{keyed.url}/openapi.json", timeout=30).json()
    for path, schema in (("/v1/rewind/sessions", "SessionList"),
                         ("/v1/rewind/status", "StatusView")):
        content = document["paths"][path]["get"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith(schema)
    assert "/" not in document["paths"]  # the page itself is not an API


def test_the_page_is_served_with_a_strict_policy(keyed):
    page = httpx.get(f"{keyed.url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "<script>" not in page.text and "sk-" not in page.text  # no inline code, no key
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        asset = httpx.get(f"{keyed.url}/ui/{name}", timeout=30)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert asset.headers["content-security-policy"] == policy
    assert httpx.get(f"{keyed.url}/ui/../pyproject.toml", timeout=30).status_code == 404
    assert httpx.get(f"{keyed.url}/ui/nothing.js", timeout=30).status_code == 404
