"""A request's hold on its model, from the first line of its handler to the last byte sent.

Handlers call `use_model(request, name, keep_alive)`; the middleware gives every lease back once
the response is over (a stream included), which is what lets an unload wait for exactly the
requests still using a model, and starts the model's keep_alive / idle clock. A response served
by a smaller form than the one named (the memory budget's fallback) says so in a header.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rewind.server.runtime import ModelRuntime

SCOPE_KEY = "rewind.leases"
FALLBACK_HEADER = b"x-rewind-model-fallback"
# The memory-budget tickets of the request being served: given back with its leases, in case
# its Generation never ran (a stream whose client left before the first byte).
_tickets: ContextVar[list[Any] | None] = ContextVar("rewind_tickets", default=None)


# The ASGI receive of the request being served: lets a wait for memory notice its client left.
_receive: ContextVar[Receive | None] = ContextVar("rewind_receive", default=None)


async def client_disconnected() -> None:
    """Returns when the client of the request being served hangs up (never, outside the
    middleware). Call it only once the request's body has been read: the only message left to
    receive then is http.disconnect."""
    receive = _receive.get()
    if receive is None:
        await asyncio.Event().wait()
        return
    while (await receive())["type"] != "http.disconnect":
        pass


def track_ticket(ticket: Any) -> None:
    tickets = _tickets.get()
    if tickets is not None:
        tickets.append(ticket)


async def use_model(request: Request, name: str | None, keep_alive: Any = None) -> ModelRuntime:
    """The runtime of the model `name` (the default when None), loaded if it was not."""
    pool = request.app.state.pool
    lease = await pool.acquire(name, keep_alive)
    leases = request.scope.get(SCOPE_KEY)
    if leases is None:  # no middleware (a route called another way): give it back at once
        lease.release()
    else:
        leases.append(lease)
    return lease.runtime


class LeaseMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Any] = []
        scope[SCOPE_KEY] = leases
        tickets: list[Any] = []
        token = _tickets.set(tickets)
        receive_token = _receive.set(receive)

        async def send_with_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                notes = [lease.fallback_note for lease in leases if lease.fallback_note]
                if notes:
                    headers = list(message.get("headers", []))
                    headers.append((FALLBACK_HEADER, notes[0].encode("latin-1", "replace")))
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_note)
        finally:
            _tickets.reset(token)
            _receive.reset(receive_token)
            for ticket in tickets:  # idempotent: most were given back by their Generation
                ticket.release()
            for lease in leases:
                lease.release()
