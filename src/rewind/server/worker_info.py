"""What a router in front of several `rewind serve` replicas asks of each one.

SGLang's router (`sglang-router` on PyPI, also sold as vLLM's `vllm-router`) registers a worker
by asking it `/server_info` and `/model_info` (the older `/get_server_info` and
`/get_model_info` as fallbacks), and files the worker under the model name it reports. Its
cache-aware policy keeps one prefix tree per model name: a worker that reports nothing is filed
under "unknown" while requests name the real model, and the policy, finding no tree for that
name, sends every request to the first worker. `/get_load` is what its load monitor polls (the
power-of-two policy uses it). These routes answer just enough for that; like /health they need no API key (they tell
no more than /health does) and are left out of /openapi.json.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(include_in_schema=False)


def _pool(request: Request) -> Any:
    return request.app.state.pool


def _default(pool: Any) -> Any:
    """The slot of the model a request naming none gets: the one a router files us under."""
    return pool.slot(None)


def server_info(pool: Any) -> dict[str, Any]:
    # No model_path on purpose: given one, the router tries to load a tokenizer from that
    # path on its own machine, which is not where the worker's folder is in general.
    slot = _default(pool)
    runtime = slot.runtime
    return {"served_model_name": slot.name, "version": "rewind",
            "max_running_requests": pool.engine_stats().get("parallel") or pool.config.engine.parallel,
            "max_total_tokens": (runtime.context_length if runtime is not None
                                 else slot.entry.context_length)}


def model_info(pool: Any) -> dict[str, Any]:
    slot = _default(pool)
    config = (slot.runtime.loaded.config if slot.runtime is not None else None) or {}
    return {"model_type": config.get("model_type"),
            "architectures": config.get("architectures"), "is_generation": True}


def load(pool: Any) -> list[dict[str, int]]:
    """One entry per data-parallel rank (a replica has one), in the shape SGLang's workers
    answer. The router reads `num_tokens` as the load; Rewind counts requests held (decoding,
    prefilling or waiting for a slot) over every loaded model, which is what its slots are
    bounded by."""
    engine = pool.engine_stats()
    queued = int(engine.get("queued", 0))
    held = int(engine.get("running", 0)) + queued
    return [{"dp_rank": 0, "num_reqs": held, "num_waiting_reqs": queued, "num_tokens": held}]


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    return JSONResponse(server_info(_pool(request)))


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request) -> JSONResponse:
    return JSONResponse(model_info(_pool(request)))


@router.get("/get_load")
async def get_load(request: Request) -> JSONResponse:
    return JSONResponse(load(_pool(request)))
