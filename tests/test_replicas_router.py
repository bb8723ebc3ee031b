"""Two `rewind serve` replicas behind SGLang's router (sglang-router, the `router` extra), on
loopback: four agent sessions, each a chat growing turn by turn, must reach the replica that holds
their prefix, so every turn after the first reports its previous prompt as cached.

The replicas are real uvicorn servers around the real engine and prompt cache (tests/live_server),
the router the real Rust binary from PyPI. A check that every later turn is cached passes
trivially when the router sends everything to one replica, so each test also asserts that both
replicas served sessions; the round-robin control shows the cached check does fail when a
session's turns are not kept together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang_router", reason="the router extra (sglang-router) is not installed")

from live_server import Live, tiny_live_server  # noqa: E402

from rewind.bench.router import ROUTING_KEY_HEADER, start_router  # noqa: E402

SESSIONS, TURNS = 4, 3
# A restore lands on a checkpoint at or just before the previous prompt's end (the template
# re-tokenizes the turn boundary): a few tokens short of it, never a 256-token block short.
BOUNDARY_SLACK = 16


@dataclass
class TurnUsage:
    prompt_tokens: int
    cached_tokens: int


@contextmanager
def two_replicas(folder: Path, scratch: Path) -> Iterator[list[Live]]:
    with ExitStack() as stack:
        yield [stack.enter_context(tiny_live_server(folder, scratch / name)) for name in "ab"]


def session_messages(session: int) -> list[dict[str, str]]:
    # Sessions differ from their first character: the router's prefix tree must not mistake one
    # session's text for another's.
    return [{"role": "user", "content": f"{'ABCD'[session]} task {session}: fix the bug in "
                                        f"module_{session}.py and run its tests. " * 6}]


def run_session(base_url: str, model: str, session: int, start: threading.Barrier | None
                ) -> list[TurnUsage]:
    messages = session_messages(session)
    usages = []
    headers = {ROUTING_KEY_HEADER: f"session-{session}"}  # only the manual policy reads it
    with httpx.Client(base_url=base_url, timeout=60, headers=headers) as client:
        if start is not None:
            start.wait()  # first turns in flight together: the router sees the load they make
        for turn in range(TURNS):
            response = client.post("/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": 6, "temperature": 0})
            assert response.status_code == 200, response.text
            body = response.json()
            usage = body["usage"]
            usages.append(TurnUsage(usage["prompt_tokens"],
                                    usage["prompt_tokens_details"]["cached_tokens"]))
            messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Tool result {session}.{turn}:\n"
                                                     + "ok: test passed\n" * 8}]
    return usages


def run_sessions(base_url: str, model: str, concurrent: bool) -> dict[int, list[TurnUsage]]:
    results: dict[int, list[TurnUsage]] = {}
    if not concurrent:
        return {s: run_session(base_url, model, s, None) for s in range(SESSIONS)}
    start = threading.Barrier(SESSIONS)
    errors: list[BaseException] = []

    def one(session: int) -> None:
        try:
            results[session] = run_session(base_url, model, session, start)
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(SESSIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return results


def turns_that_missed(results: dict[int, list[TurnUsage]]) -> list[tuple[int, int]]:
    """(session, turn) of every later turn that did not restore its previous prompt."""
    missed = []
    for session, usages in results.items():
        for turn in range(1, len(usages)):
            if usages[turn].cached_tokens < usages[turn - 1].prompt_tokens - BOUNDARY_SLACK:
                missed.append((session, turn))
    return missed


def requests_served(replica: Live) -> int:
    return int(replica.engine.stats()["requests_finished"])


@pytest.mark.parametrize("policy", ["cache_aware", "manual"])
def test_every_later_turn_reaches_the_replica_holding_its_prefix(
        policy: str, tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    with two_replicas(tiny_model_path("llama"), tmp_path) as replicas:
        router = start_router([r.url for r in replicas], policy, tmp_path, replicas[0].model)
        try:
            registered = httpx.get(router.base_url + "/workers", timeout=10).json()["workers"]
            loads = httpx.get(router.base_url + "/get_loads", timeout=10).json()["workers"]
            results = run_sessions(router.base_url, replicas[0].model, concurrent=True)
        finally:
            router.stop()
        served = [requests_served(r) for r in replicas]
    # The router filed both replicas under the model they serve (/server_info) and can read
    # their load (/get_load); without those routes it files them under "unknown", load -1.
    assert [w["model_id"] for w in registered] == [replicas[0].model] * 2
    assert [w["load"] for w in loads] == [0, 0]
    assert len(results) == SESSIONS
    assert all(usages[0].cached_tokens == 0 for usages in results.values())
    assert turns_that_missed(results) == []
    # Both replicas took whole sessions (a session's turns stay on one replica).
    assert sorted(served) != [0, SESSIONS * TURNS] and all(n % TURNS == 0 for n in served), served


def test_round_robin_splits_sessions_and_loses_their_prefix(
        tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """The control: one session at a time through round-robin alternates each session's turns
    between the replicas, so its later turns find their previous prompt on the other one."""
    with two_replicas(tiny_model_path("llama"), tmp_path) as replicas:
        router = start_router([r.url for r in replicas], "round_robin", tmp_path,
                              replicas[0].model)
        try:
            results = run_sessions(router.base_url, replicas[0].model, concurrent=False)
        finally:
            router.stop()
    assert len(turns_that_missed(results)) >= SESSIONS
