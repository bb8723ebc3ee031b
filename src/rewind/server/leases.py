"""A request's hold on its model, from the first line of its handler to the last byte sent.

Handlers call `use_model(request, name, keep_alive)`; the middleware gives every lease back once
the response is over (a stream included), which is what lets an unload wait for exactly the
requests still using a model, and starts the model's keep_alive / idle clock. A response served
by a smaller form than the one named (the memory budget's fallback) says so in a header. The
middleware also opens the request's scope (rewind.server.request_context): the memory tickets it
gives back at the end, and its client's disconnect.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rewind.server.request_context import serving
from rewind.server.runtime import ModelRuntime

SCOPE_KEY = "rewind.leases"
FALLBACK_HEADER = b"x-rewind-model-fallback"


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

        async def send_with_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                notes = [lease.fallback_note for lease in leases if lease.fallback_note]
                if notes:
                    headers = list(message.get("headers", []))
                    headers.append((FALLBACK_HEADER, notes[0].encode("latin-1", "replace")))
                    message = {**message, "headers": headers}
            await send(message)

        try:
            with serving(receive, tickets):
                await self.app(scope, receive, send_with_note)
        finally:
            for ticket in tickets:  # idempotent: most were given back by their Generation
                ticket.release()
            for lease in leases:
                lease.release()
