"""/v1/models (every servable model, loaded or not), and loading / unloading by name."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rewind.server.body import parse_body
from rewind.server.openapi import json_body
from rewind.server.schemas import ModelActionRequest

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> Any:
    pool = request.app.state.pool
    return {"object": "list", "data": [pool.describe(slot) for slot in pool.slots()]}


@router.post("/v1/models/load", openapi_extra=json_body(ModelActionRequest))
async def load_model(request: Request) -> Any:
    """Load a model now (the first request that names it would): it stays for `keep_alive`
    (Ollama's spelling; -1 forever), else the server's --idle-unload."""
    pool = request.app.state.pool
    body = await parse_body(request, ModelActionRequest, request.app.state.config)
    slot = await pool.load(body.model, body.keep_alive)
    return pool.describe(slot)


@router.post("/v1/models/unload", openapi_extra=json_body(ModelActionRequest))
async def unload_model(request: Request) -> Any:
    """Unload a model once its running requests end; its prompt-cache records stay."""
    pool = request.app.state.pool
    body = await parse_body(request, ModelActionRequest, request.app.state.config)
    slot = await pool.unload(body.model)
    return pool.describe(slot)


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Any:
    pool = request.app.state.pool
    return pool.describe(pool.slot(model_id))
