"""kill -9 of `rewind serve` while it streams and while its disk tier writes, then a restart on the
same cache folder: the client sees a clean connection error (no hang), nothing is left in the
cache folder, and the new server serves the same answers. With --cache-persist, a server stopped
or killed -9 and restarted on the same folder serves the earlier prompt from the persisted
cache."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import greedy_completion

from rewind.bench.harness import ServerProcess, free_port

PROMPT = [(13 * i) % 500 + 3 for i in range(700)]


def start(folder: Path, cache_dir: Path, log: Path) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", str(folder), "--port", str(port),
            "--cache-dir", str(cache_dir), "--cache-ram", "0", "--log-level", "warning"]
    server = ServerProcess("rewind", argv, port, log, ready_paths=("/health",)).start()
    server.wait_ready(120)
    return server


def greedy(url: str, prompt: list[int], tokens: int = 6) -> list[str]:
    return greedy_completion(url, prompt, tokens)[0]


@pytest.mark.slow
def test_kill_9_while_streaming_and_writing_then_restart(tiny_model_path, tmp_path):
    folder = tiny_model_path("llama")
    cache_dir = tmp_path / "cache"
    server = start(folder, cache_dir, tmp_path / "first.log")
    url = server.base_url
    before = greedy(url, PROMPT)
    endless = {"prompt": PROMPT[:50], "max_tokens": 3000, "stream": True, "temperature": 0,
               "logit_bias": {str(token): -100 for token in range(0, 4)}}
    failure: list[BaseException] = []

    def writes() -> None:  # keep the disk writer busy: every block goes to disk (no RAM tier)
        try:
            for i in range(200):
                greedy(url, [(17 * i + k) % 500 + 3 for k in range(600)], 1)
        except BaseException as error:  # noqa: BLE001 - the kill ends this loop
            failure.append(error)

    writer = threading.Thread(target=writes, daemon=True)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/completions", json=endless) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            writer.start()
            time.sleep(1.5)  # streaming and writing records at once
            os.kill(server.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(httpx.TransportError):
                for _ in lines:
                    pass
            assert time.monotonic() - started < 10  # an error at once, not a hang
    writer.join(30)
    assert failure and isinstance(failure[0], httpx.TransportError)
    server.stop()
    assert list(cache_dir.iterdir()) == []  # the scratch file had no name: nothing to repair

    again = start(folder, cache_dir, tmp_path / "second.log")
    try:
        assert greedy(again.base_url, PROMPT) == before
        assert greedy(again.base_url, PROMPT) == before  # now from its own disk tier
    finally:
        again.stop()
    assert list(cache_dir.iterdir()) == []


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(f"{name} "))


@pytest.mark.slow
# SIGINT on demand (~7 s; CI neared its 20 minutes): uvicorn handles it as it does SIGTERM,
# and test_server_cli stops a server with it.
@pytest.mark.parametrize("stop_signal", [
    pytest.param(signal.SIGTERM, id="SIGTERM"),
    pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.on_demand),
    pytest.param(signal.SIGKILL, id="SIGKILL")])
def test_a_stopped_or_killed_persistent_server_resumes_after_restart(tiny_model_path, tmp_path,
                                                                    stop_signal):
    """`rewind serve --cache-persist` stopped as a user stops it (SIGTERM; Ctrl-C is SIGINT), or
    killed with -9 (what a native crash amounts to: nothing runs at exit; a supervisor restarts
    it, docs/SUPERVISED.md): the server restarted on the same --cache-dir serves the earlier
    prompt from the persisted cache, with the same greedy answer. A killed server writes no
    index at exit: it has the one its disk writer wrote once idle (5 s after the last record),
    which /metrics shows as rewind_prompt_cache_unindexed_changes 0."""
    folder = tiny_model_path("llama")
    cache_dir = tmp_path / "cache"

    def serve(log: str) -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "rewind", "serve", "--model", str(folder), "--port",
                str(port), "--cache-dir", str(cache_dir), "--cache-persist",
                "--log-level", "warning"]
        server = ServerProcess("rewind", argv, port, tmp_path / log, ready_paths=("/health",))
        server.start().wait_ready(120)
        return server

    def ask(url: str) -> tuple[list[str], int]:
        return greedy_completion(url, PROMPT, 6)

    first = serve("first.log")
    try:
        answer, cached = ask(first.base_url)
        assert cached == 0
        if stop_signal == signal.SIGKILL:
            # Until the records are on the disk and in its index: the request's records reach
            # the disk writer's queue after its answer, so a queue and an index with nothing
            # left to write may only mean that they have not come yet.
            deadline = time.monotonic() + 60
            while (not metric(first.base_url, 'rewind_prompt_cache_bytes{tier="disk"}')
                   or metric(first.base_url, "rewind_prompt_cache_disk_queued_bytes")
                   or metric(first.base_url, "rewind_prompt_cache_unindexed_changes")):
                assert time.monotonic() < deadline, "the index was never written"
                time.sleep(0.1)
        first.process.send_signal(stop_signal)
        assert first.process.wait(30) in (0, -stop_signal, 128 + stop_signal)
    finally:
        first.stop()
    again = serve("again.log")
    try:
        assert metric(again.base_url, "rewind_prompt_cache_loaded_records") > 0
        # The whole prompt but its last token, from the disk, and the same answer.
        assert ask(again.base_url) == (answer, len(PROMPT) - 1)
    finally:
        again.stop()
