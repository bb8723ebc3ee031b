"""Reading and validating a JSON request body, with errors in the caller's API shape.

Everything malformed stops here, before any handler, template or native code sees it: bodies that
are too large, too slow or cut off, JSON that Python's parser accepts but JSON does not (NaN,
Infinity, numbers that overflow a double), nesting deep enough to exhaust the interpreter's stack,
and strings that cannot be encoded as UTF-8 (a lone surrogate escape such as "\\ud800").
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from rewind.config import ServerConfig
from rewind.server.errors import ApiError, bad_request, validation_message

Model = TypeVar("Model", bound=BaseModel)

# No API body needs more: OpenAI's and Anthropic's own schemas nest a tool's JSON schema a few
# levels deep. Python's json module would recurse until RecursionError at ~1,000.
MAX_JSON_DEPTH = 64
# Only bodies holding a surrogate escape can decode to a string that is not valid Unicode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ClientGone(ApiError):
    """The client closed the connection before its body arrived: nobody reads the answer, and
    it is no server error (nginx logs this as 499)."""

    def __init__(self) -> None:
        super().__init__(499, "invalid_request", "the client closed the connection before "
                         "sending the whole request body")


async def read_body(request: Request, limit: int, idle_seconds: float) -> bytes:
    """The raw body, refusing (413) past `limit` bytes without reading the rest, and (408) when
    no byte of it arrives for `idle_seconds`."""
    too_large = ApiError(413, "too_large", f"request body is larger than the limit of {limit} "
                         "bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), idle_seconds)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError as exc:
            raise ApiError(408, "invalid_request", f"no part of the request body arrived for "
                           f"{idle_seconds:g} s", headers={"Connection": "close"}) from exc
        except ClientDisconnect as exc:
            raise ClientGone() from exc
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def _check_shape(data: Any, check_strings: bool) -> None:
    """Depth at most MAX_JSON_DEPTH and (when asked) every string and key valid UTF-8; walked
    with a stack, so a deep document cannot exhaust the interpreter's."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            for key, item in value.items():
                if check_strings:
                    _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((item, depth + 1) for item in value)
        elif check_strings and isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start:exc.end].encode("unicode_escape").decode("ascii")
        raise bad_request(f"a string in the request body is not valid Unicode: it holds the lone "
                          f"surrogate {bad} (surrogate escapes must come in pairs)") from exc


def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object that every later step can take: finite numbers, bounded depth, UTF-8 text."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad_request(f"malformed JSON in the request body: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_shape(data, check_strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return data


async def parse_body(request: Request, model: type[Model], config: ServerConfig) -> Model:
    raw = await read_body(request, config.max_body_bytes, config.body_idle_seconds)
    data = parse_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors(), data)
        raise bad_request(message, param=param) from exc
