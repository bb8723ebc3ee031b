"""One generation as the HTTP side sees it: engine events -> parsed pieces (content, reasoning,
tool calls), cancelled when the client goes away, counted in the metrics when it ends."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from rewind.engine import FinishEvent, RequestHandle, TokenEvent, Usage
from rewind.server.auth import request_tenant
from rewind.server.errors import ApiError
from rewind.server.sessions import SessionBook, TurnStart
from rewind.server.tool_parsing import OutputSplitter, Piece

log = logging.getLogger(__name__)


async def _cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """Wait for the client to hang up, then free the engine slot. The body is already read, so
    the only message left to receive is http.disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


def _begin_turn(runtime: Any, api: str, request: Request, handle: RequestHandle
                ) -> tuple[SessionBook, TurnStart] | None:
    """File the request under its client session (rewind.server.sessions), where the app keeps
    a session book and the handle says what was submitted."""
    book = getattr(request.app.state, "sessions", None)
    submitted = getattr(handle, "submitted", None)
    if book is None or submitted is None:
        return None
    tenant, _ = request_tenant(request.scope)
    extras = submitted.extras
    start = book.begin(tenant=tenant, salt=extras.salt if extras is not None else "",
                       model=runtime.model_id, api=api, tokens=submitted.prompt_tokens,
                       checkpoints=submitted.checkpoints, headers=request.headers)
    return book, start


KEEPALIVE_SECONDS = 10.0  # a long prefill sends no token for minutes; idle readers time out


class Generation:
    """Started at submit time: a disconnect watcher frees the engine slot whenever the client
    goes away, even before the response body is first iterated."""

    def __init__(self, runtime: Any, api: str, request: Request, handle: RequestHandle,
                 splitter: OutputSplitter, keep_tokens: bool = False) -> None:
        self.runtime = runtime
        self.api = api
        self.handle = handle
        self.splitter = splitter
        self.keep_tokens = keep_tokens
        self.token_events: list[TokenEvent] = []
        self.finish: FinishEvent | None = None
        self._watcher = asyncio.create_task(_cancel_on_disconnect(request, handle))
        self._turn = _begin_turn(runtime, api, request, handle)

    @property
    def cut_reason(self) -> str | None:
        """Why the engine cut the answer short of its max_tokens (the memory budget), if it
        did: a "length" finish that carries a reason."""
        finish = self.finish
        return finish.error if finish is not None and finish.reason == "length" else None

    @property
    def usage(self) -> Usage:
        return self.finish.usage if self.finish is not None else Usage()

    async def cached_tokens_at_admission(self, timeout: float) -> int | None:
        """Prompt tokens restored from the cache, once the request holds a slot (None if it
        waits for one longer than `timeout` seconds)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.handle.admitted.is_set():
            if asyncio.get_running_loop().time() >= deadline:
                return None
            await asyncio.sleep(0.01)
        usage = self.handle.usage
        return usage.cached_tokens if usage is not None else None

    @property
    def saw_tool_call(self) -> bool:
        return self.splitter.saw_tool_call

    async def pieces(self, keepalive_seconds: float | None = None
                     ) -> AsyncIterator[Piece | None]:
        """Parsed pieces; None every `keepalive_seconds` without one (the caller sends a
        keep-alive). Ends after the engine's FinishEvent, which is then in `self.finish`."""
        try:
            # The handle's own queue, keep-alives included: no task or timer per token
            async for event in self.handle.stream(keepalive_seconds):
                if event is None:
                    yield None
                    continue
                if isinstance(event, TokenEvent):
                    if self.keep_tokens:
                        self.token_events.append(event)
                    for piece in self.splitter.feed(event.text):
                        yield piece
                else:
                    self.finish = event
                    for piece in self.splitter.finish():
                        yield piece
        finally:
            self._watcher.cancel()
            self.handle.cancel()  # a no-op once finished; frees the slot when we stop early
            outcome = self.finish.reason if self.finish is not None else "cancelled"
            self.runtime.metrics.on_finish(self.api, outcome, self.usage)
            if self._turn is not None:
                book, start = self._turn
                book.finish(start, outcome, self.usage)

    async def collect(self) -> list[Piece]:
        """The whole output; an engine error becomes a 500."""
        pieces = [piece async for piece in self.pieces() if piece is not None]
        if self.finish is not None and self.finish.reason == "error":
            raise ApiError(500, "server", f"generation failed: {self.finish.error}")
        return pieces


SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every client's parser skips it


def sse_data(payload: dict[str, Any] | str) -> str:
    """An OpenAI-style server-sent event (data only)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n"


def sse_event(name: str, payload: dict[str, Any]) -> str:
    """An Anthropic / Responses-style server-sent event (named)."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
