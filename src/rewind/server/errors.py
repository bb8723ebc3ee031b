"""HTTP errors, rendered in the shape of the API that was called.

Handlers raise ApiError with an HTTP status and a neutral kind; the app's exception handler picks
the OpenAI shape (`{"error": {...}}`) or the Anthropic shape (`{"type": "error", "error": {...}}`)
from the request path, so every module raises the same thing and no client sees a foreign shape.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse

ApiFlavor = Literal["openai", "anthropic"]

# Neutral kind -> (OpenAI error type, Anthropic error type).
_KIND_TYPES: dict[str, tuple[str, str]] = {
    "invalid_request": ("invalid_request_error", "invalid_request_error"),
    "authentication": ("authentication_error", "authentication_error"),
    "permission": ("permission_error", "permission_error"),
    "not_found": ("not_found_error", "not_found_error"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit": ("rate_limit_error", "rate_limit_error"),
    "overloaded": ("server_error", "overloaded_error"),
    "server": ("server_error", "api_error"),
}


class ApiError(Exception):
    """An error answer: status code, kind (a key of _KIND_TYPES), message, and optional details."""

    def __init__(self, status: int, kind: str, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        if kind not in _KIND_TYPES:
            raise ValueError(f"unknown error kind {kind!r}")
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param, code=code)


def flavor_for_path(path: str) -> ApiFlavor:
    """Anthropic's Messages API lives under /v1/messages; everything else speaks OpenAI."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(error: ApiError, flavor: ApiFlavor) -> dict[str, Any]:
    openai_type, anthropic_type = _KIND_TYPES[error.kind]
    if flavor == "anthropic":
        return {"type": "error", "error": {"type": anthropic_type, "message": error.message}}
    return {"error": {"message": error.message, "type": openai_type, "param": error.param,
                      "code": error.code}}


def error_response(error: ApiError, flavor: ApiFlavor) -> JSONResponse:
    return JSONResponse(error_body(error, flavor), status_code=error.status, headers=error.headers)


def validation_message(errors: list[dict[str, Any]],
                       body: Any = None) -> tuple[str, str | None]:
    """Pydantic's error list -> one readable message and the offending parameter's dotted path.
    With the request `body`, the path keeps only the parts that name something in it: pydantic
    puts the names of a union's members (`constrained-str`, `list[int]`, a model's class name)
    between the real keys."""
    if not errors:
        return "invalid request body", None
    # The deepest error is the most specific one: in a union, the member that got furthest.
    first = max(errors, key=lambda error: len(error.get("loc", ())))
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if body is not None:
        loc = _keys_in(body, loc)
    param = ".".join(str(part) for part in loc) or None
    message = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return f"{where}{message}{more}", param


def _keys_in(body: Any, loc: list[Any]) -> list[Any]:
    kept, node = [], body
    for position, part in enumerate(loc):
        indexes = (isinstance(node, dict) and isinstance(part, str) and part in node
                   or isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if indexes:
            node = node[part]
            kept.append(part)
        elif position == len(loc) - 1 and isinstance(node, dict):
            kept.append(part)  # a required field that is missing
    return kept
