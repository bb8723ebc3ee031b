"""API-key check for every /v1 route: `Authorization: Bearer KEY` (OpenAI clients) or
`x-api-key: KEY` (Anthropic clients). /health and /metrics stay open for probes and scrapers."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from rewind.server.errors import ApiError, error_response, flavor_for_path


def presented_key(headers: dict[str, str]) -> str | None:
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def key_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.api_key or not path.startswith("/v1"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        presented = presented_key(headers)
        if key_matches(presented, self.api_key):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if presented is None else "invalid API key"
        error = ApiError(401, "authentication", f"{message}: send `Authorization: Bearer <key>` "
                         "or `x-api-key: <key>`", code="invalid_api_key")
        await error_response(error, flavor_for_path(path))(scope, receive, send)
