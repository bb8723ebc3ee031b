"""The last line of defence: an exception no handler caught becomes a 500 in the API's own shape,
and the connection stays usable for the client's next request."""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rewind.server.errors import ApiError, error_response, flavor_for_path

log = logging.getLogger(__name__)


class ErrorShield:
    def __init__(self, app: ASGIApp, on_error: Callable[[], None]) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            path = scope.get("path", "")
            log.exception("unhandled error on %s", path)
            self.on_error()
            if started:  # a stream already under way cannot change its status: end it
                raise
            error = ApiError(500, "server", f"internal error: {type(exc).__name__}: {exc}")
            await error_response(error, flavor_for_path(path))(scope, receive, send)
