"""Reading and validating a JSON request body, with errors in the caller's API shape."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from rewind.server.errors import ApiError, bad_request, validation_message

Model = TypeVar("Model", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) past `limit` bytes without reading the rest."""
    too_large = ApiError(413, "too_large", f"request body is larger than the limit of {limit} "
                         "bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[Model], limit: int) -> Model:
    raw = await read_body(request, limit)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON in the request body: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise bad_request(message, param=param) from exc
