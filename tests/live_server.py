"""A real uvicorn server on a free loopback port, in a background thread, for live-server tests."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

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
