"""The FastAPI app factory: routes, error handlers in each API's shape, auth, /health, /metrics,
and the web page at /."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rewind.config import ServerConfig
from rewind.server import (
    anthropic_api,
    dashboard_api,
    models_api,
    openai_api,
    pull_api,
    responses_api,
    web,
    worker_info,
)
from rewind.server.auth import ApiKeyMiddleware, key_ring
from rewind.server.errors import ApiError, error_response, flavor_for_path, validation_message
from rewind.server.error_shield import ErrorShield
from rewind.server.leases import LeaseMiddleware
from rewind.server.metrics import ServerMetrics
from rewind.server.openapi import describe_bodies
from rewind.server.sessions import SessionBook

log = logging.getLogger(__name__)

_STATUS_KINDS = {401: "authentication", 404: "not_found", 405: "invalid_request",
                 413: "too_large", 429: "rate_limit"}


def create_app(loaded: Any, engine: Any, config: ServerConfig | None = None,
               prompt_cache: Any = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """An app around one loaded model and a started engine (the caller owns their lifetimes;
    `on_shutdown` runs when the server stops, e.g. to close them)."""
    from rewind.server.pool_setup import single_model_pool

    config = config or ServerConfig()
    return create_pool_app(single_model_pool(loaded, engine, config, prompt_cache), config,
                           on_shutdown)


def create_pool_app(pool: Any, config: ServerConfig,
                    on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """An app serving every model of `pool` (rewind.server.model_pool.ModelPool)."""
    server_metrics: ServerMetrics = pool.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool.start()
        yield
        await pool.shutdown()
        # Here, not after uvicorn.run() returns: on SIGINT / SIGTERM uvicorn re-raises the
        # signal once it has shut down, so code after run() never runs and a persistent prompt
        # cache would lose its final index.
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="Rewind", version="0.1.0", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.pool = pool
    app.state.config = config
    app.state.sessions = SessionBook(config.max_sessions, config.engine.cache.block_tokens)
    app.include_router(openai_api.router)
    app.include_router(models_api.router)
    app.include_router(pull_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(worker_info.router)
    app.include_router(dashboard_api.router)
    app.include_router(web.router)
    app.add_middleware(LeaseMiddleware)
    app.add_middleware(ApiKeyMiddleware, keys=key_ring(config))
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins,
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                           expose_headers=["Retry-After"])
    # Outermost: a bug in a handler becomes a 500 in the API's shape on a connection that stays
    # usable (Starlette's own last-resort handler answers and then re-raises, so uvicorn drops
    # the keep-alive connection under the client's next request).
    app.add_middleware(ErrorShield,
                       on_error=lambda: server_metrics.http_errors.labels("500").inc())
    describe_bodies(app, lambda: sorted({name for entry in pool.catalog.entries
                                         for name in entry.names}))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        server_metrics.http_errors.labels(str(exc.status)).inc()
        return error_response(exc, flavor_for_path(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return await api_error(request, ApiError(400, "invalid_request", message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _STATUS_KINDS.get(exc.status_code, "invalid_request" if exc.status_code < 500
                                 else "server")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        # The 405's Allow header (RFC 9110) comes in exc.headers.
        return await api_error(request, ApiError(exc.status_code, kind, message,
                                                 headers=dict(exc.headers or {})))


    @app.get("/health")
    async def health() -> JSONResponse:
        if not pool.healthy():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "model": pool.default_model,
                             "loaded": [slot.name for slot in pool.loaded()]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server_metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
