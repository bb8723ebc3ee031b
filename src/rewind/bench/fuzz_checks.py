"""Schemathesis checks for `rewind bench fuzz` (loaded through SCHEMATHESIS_HOOKS).

Besides schemathesis's own `not_a_server_error`: every error answer must be in the shape of the
API that was called (a client parses it with its own error types), and every body must be
strict JSON (Python's json writes NaN and Infinity, which no other parser takes)."""

from __future__ import annotations

import json
from typing import Any

import schemathesis


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the response: not JSON")
    return json.loads(text, parse_constant=refuse)


def _bodies(response: Any) -> list[str]:
    """The JSON documents of a response: the body, or each SSE event's data."""
    text = response.content.decode("utf-8")
    if "text/event-stream" not in str(response.headers.get("content-type", "")):
        return [text]
    return [line[len("data: "):] for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@schemathesis.check
def error_in_api_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code < 400:
        return None
    body = _strict(response.content.decode("utf-8"))
    if case.path.startswith("/v1/messages"):
        assert body.get("type") == "error", f"not an Anthropic error: {body}"
        assert {"type", "message"} <= set(body["error"]), f"not an Anthropic error: {body}"
    else:
        assert set(body.get("error", {})) == {"message", "type", "param", "code"}, \
            f"not an OpenAI error: {body}"
    return True


@schemathesis.check
def strict_json_bodies(ctx: Any, response: Any, case: Any) -> bool | None:
    if case.path in ("/metrics",):
        return None
    for document in _bodies(response):
        if document.strip():
            _strict(document)
    return True
