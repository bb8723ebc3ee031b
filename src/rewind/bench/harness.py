"""Start, wait for and stop one server process on a free loopback port, and sample its memory.

Every server under comparison (Rewind, mlx-lm, llama.cpp) runs as a child process that the bench
starts itself, so each one is measured from a cold start, with nothing shared between them but
the machine. Memory is the resident set size of the process and of all its children (a server
may fork workers), sampled by a background thread so a curve over time can be plotted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

LOOPBACK = "127.0.0.1"


# Servers started and not yet stopped, so a signal handler can stop them all at once.
_LIVE: set["ServerProcess"] = set()


def stop_all_servers() -> None:
    for server in list(_LIVE):
        server.stop(grace=5.0)


class ServerStartError(RuntimeError):
    """The server exited or never became ready; the message carries the tail of its log."""


def free_port() -> int:
    """A port that was free a moment ago on loopback (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def free_port_run(count: int, tries: int = 50) -> int:
    """The first of `count` consecutive ports that were all free a moment ago on loopback:
    `mlx.launch --backend ring -p P` gives rank i port P + i, and a free P alone left rank 1 to
    find P + 1 taken ("Couldn't bind socket", seen in CI)."""
    for _ in range(tries):
        base = free_port()
        if base + count > 65536:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(sock)
                sock.bind((LOOPBACK, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no run of {count} free ports on loopback in {tries} tries")


def tree_rss_bytes(pid: int) -> int:
    """RSS of a process and all its descendants; 0 once it is gone."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            continue  # a child that exited between listing and reading
    return total


class RssSampler:
    """Samples tree_rss_bytes(pid) every `interval` seconds on a daemon thread.

    `samples` holds (seconds since start, bytes); `mark(label)` records a named moment (e.g.
    "loaded", "run done") so reports can read the RSS at those points.
    """

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.marks: dict[str, tuple[float, int]] = {}
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rss-{pid}", daemon=True)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        rss = tree_rss_bytes(self.pid)
        self.samples.append((time.monotonic() - self._started, rss))
        return rss

    def mark(self, label: str) -> int:
        rss = self.sample()
        self.marks[label] = (time.monotonic() - self._started, rss)
        return rss

    def peak(self) -> int:
        return max((rss for _, rss in self.samples), default=0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


@dataclass(eq=False)  # hashed by identity: kept in _LIVE
class ServerProcess:
    """One server child process. `argv` must already contain the port; `ready_paths` are polled
    in order until one answers 200 (servers differ: /health, /v1/models)."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")
    # The `model` field requests carry; None: the first id that /v1/models lists once ready.
    model_id: str | None = None
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_seconds: float = 0.0

    @property
    def command(self) -> str:
        """The command line as a user would type it (for the reports)."""
        from rewind.bench.machine import user_command

        return user_command(self.argv)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "server not started"
        return self.process.pid

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = {**os.environ, **self.env}
        self.started_at = time.monotonic()
        # A new session, so stop() can signal the whole group (servers that fork workers).
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()  # the child holds its own descriptor
        _LIVE.add(self)
        return self

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Blocks until a ready path answers 200; returns seconds since start."""
        deadline = self.started_at + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    raise ServerStartError(f"{self.name} exited with code "
                                           f"{self.process.returncode if self.process else '?'}"
                                           f"\n{self.log_tail()}")
                for path in self.ready_paths:
                    try:
                        if client.get(self.base_url + path).status_code == 200:
                            self.ready_seconds = time.monotonic() - self.started_at
                            if self.model_id is None:
                                self.model_id = self._first_listed_model(client)
                            return self.ready_seconds
                    except httpx.HTTPError:
                        pass  # not listening yet
                time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"{self.name} not ready after {timeout:.0f}s\n{self.log_tail()}")

    def _first_listed_model(self, client: httpx.Client) -> str:
        try:
            listed = client.get(self.base_url + "/v1/models").json().get("data") or []
        except (httpx.HTTPError, ValueError):
            listed = []
        return str(listed[0]["id"]) if listed else "default"

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the process group, then SIGKILL after `grace` seconds."""
        _LIVE.discard(self)
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=5)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
