"""`rewind serve` as a user runs it, in a subprocess on a free loopback port, with its own hub
cache, REWIND_HOME and HF_ENDPOINT (huggingface_hub reads that at import, so a hub on loopback
can only be named in a fresh process's environment)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(server: subprocess.Popen, url: str, seconds: float) -> None:
    """Until `url`/health answers 200; fails with the server's output if it exits first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read() if server.stdout else ""
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("rewind serve did not become healthy")


@contextmanager
def rewind_serve(model: Path, tmp_path: Path, hub_url: str, *flags: str) -> Iterator[str]:
    """`rewind serve` as a user runs it, with HF_ENDPOINT at the fake hub (huggingface_hub
    reads it at import, so it must be in the process's environment) and its own caches."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_ENDPOINT": hub_url,
           "HF_HUB_CACHE": str(tmp_path / "hub"), "REWIND_HOME": str(tmp_path / "home"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    command = [sys.executable, "-m", "rewind", "serve", "--model", str(model), "--port",
               str(port), "--cache-dir", str(tmp_path / "scratch"), "--log-level", "warning",
               *flags]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 180)
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
