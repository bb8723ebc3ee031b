"""What the server knows of the request being served, wherever its code runs: the memory-budget
tickets it holds and whether its client is still there. LeaseMiddleware (rewind.server.leases)
opens the scope for each HTTP request; a model's runtime (rewind.server.runtime) reads it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from starlette.types import Receive

# The memory-budget tickets of the request being served: given back with its leases, in case
# its Generation never ran (a stream whose client left before the first byte).
_tickets: ContextVar[list[Any] | None] = ContextVar("rewind_tickets", default=None)


# The ASGI receive of the request being served: lets a wait for memory notice its client left.
_receive: ContextVar[Receive | None] = ContextVar("rewind_receive", default=None)


@contextmanager
def serving(receive: Receive, tickets: list[Any]) -> Iterator[None]:
    """The scope of one request: `track_ticket` appends to `tickets`, `client_disconnected`
    listens on `receive`."""
    token = _tickets.set(tickets)
    receive_token = _receive.set(receive)
    try:
        yield
    finally:
        _tickets.reset(token)
        _receive.reset(receive_token)


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
