"""A recording reverse proxy on loopback: what a real client sends to the server, and what it gets.

Every request is forwarded to `upstream` as is and its answer streamed back as it arrives (chunked),
so the client sees the server's own timing and event order. Each exchange is kept in `exchanges`:
method, path, request headers and body, response status, headers and body (the raw SSE text of a
stream). Used by the agent tests to check the traffic of Claude Code and codex, and to record it.

`answer`, when set, may answer a request itself (a canned model turn, e.g. a tool call the tiny
random model would never make): it gets the Exchange and returns an SSE body, or None to forward.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any

import httpx

# Hop-by-hop headers: not forwarded either way.
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate", "content-length", "host",
       "accept-encoding", "content-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    request_headers: dict[str, str]
    request_body: bytes
    started: float
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytes = b""
    seconds: float = 0.0
    error: str | None = None
    canned: bool = False  # answered by the proxy's `answer`, not by the server
    # (seconds since the request came in, bytes of the answer so far) at each chunk forwarded
    chunks: list[tuple[float, int]] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.request_body) if self.request_body else None

    def sse_events(self) -> list[tuple[str | None, Any]]:
        """(event name, parsed data) of each server-sent event of a streamed answer."""
        events: list[tuple[str | None, Any]] = []
        for block in self.response_body.decode("utf-8", "replace").split("\n\n"):
            name, data = None, []
            for line in block.splitlines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip())
            if data:
                text = "\n".join(data)
                try:
                    events.append((name, json.loads(text)))
                except ValueError:
                    events.append((name, text))
        return events

    def seconds_to(self, marker: bytes) -> float | None:
        """When the chunk holding the first occurrence of `marker` was forwarded (e.g.
        b"_delta" for the first token of a stream)."""
        at = self.response_body.find(marker)
        if at < 0:
            return None
        return next((t for t, size in self.chunks if size > at), None)

    def first_token_seconds(self) -> float | None:
        """When the first delta event of a Messages or Responses stream was forwarded."""
        times = [self.seconds_to(marker) for marker in (b'"content_block_delta"', b'.delta"')]
        return min((t for t in times if t is not None), default=None)

    @property
    def streamed(self) -> bool:
        return "text/event-stream" in self.response_headers.get("content-type", "")


class RecordingProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.answer: Callable[[Exchange], bytes | None] | None = None
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                exchange = Exchange(self.command, self.path, headers, body, time.monotonic())
                with proxy._lock:
                    proxy.exchanges.append(exchange)
                canned = proxy.answer(exchange) if proxy.answer is not None else None
                if canned is not None:
                    exchange.canned, exchange.status = True, 200
                    exchange.response_headers = {"content-type": "text/event-stream"}
                    exchange.response_body = canned
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("content-length", str(len(canned)))
                    self.end_headers()
                    self.wfile.write(canned)
                    self.wfile.flush()
                    exchange.seconds = time.monotonic() - exchange.started
                    return
                forward = {k: v for k, v in headers.items() if k not in HOP}
                try:
                    request = proxy._client.build_request(self.command, proxy.upstream + self.path,
                                                          headers=forward, content=body)
                    response = proxy._client.send(request, stream=True)
                except httpx.HTTPError as exc:
                    exchange.error = repr(exc)
                    exchange.status = 502
                    self.send_response(502)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                try:
                    exchange.status = response.status_code
                    exchange.response_headers = {k.lower(): v for k, v in response.headers.items()}
                    self.send_response(response.status_code)
                    for key, value in response.headers.items():
                        if key.lower() not in HOP:
                            self.send_header(key, value)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    received = bytearray()
                    for chunk in response.iter_raw():
                        received += chunk
                        exchange.chunks.append((time.monotonic() - exchange.started,
                                                len(received)))
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                    exchange.response_body = bytes(received)
                except (OSError, httpx.HTTPError) as exc:  # the client went away mid-stream
                    exchange.error = repr(exc)
                finally:
                    response.close()
                    exchange.seconds = time.monotonic() - exchange.started

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "RecordingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

    def take(self) -> list[Exchange]:
        """The exchanges so far, and forget them."""
        with self._lock:
            taken, self.exchanges = self.exchanges, []
        return taken
