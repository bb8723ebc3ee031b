"""/v1/rewind/sessions and /v1/rewind/status: what the web page's sessions view shows.

Both sit under /v1, so they take the API key when one is set. Sessions are a tenant's own (an
admin key sees all); the status is server-wide, as /metrics already is: tiers, the memory
budget, the requests running and waiting, and the models.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request

from rewind.server.auth import request_tenant
from rewind.server.dashboard_schemas import (
    CacheView,
    MemoryView,
    ModelView,
    RequestsView,
    SessionList,
    SessionTotals,
    SessionView,
    StatusView,
    TierView,
    TurnView,
)
from rewind.server.sessions import Session, SessionBook

router = APIRouter()

_CACHE_COUNTERS = ("tokens_requested", "tokens_restored", "tokens_restored_ram",
                   "tokens_restored_disk", "tokens_recomputed")


def session_view(session: Session) -> SessionView:
    totals = {key: int(value) for key, value in session.totals.items()}
    return SessionView(
        id=session.id, tenant=session.tenant, source=session.source, model=session.model,
        anchor_tokens=session.anchor_tokens, started=session.started,
        last_seen=session.last_seen, turn_count=session.turn_count,
        totals=SessionTotals(**totals),
        turns=[TurnView(at=t.at, model=t.model, api=t.api, outcome=t.outcome,
                        prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
                        ram_tokens=t.ram_tokens, disk_tokens=t.disk_tokens,
                        recomputed_tokens=t.recomputed_tokens, ttft_seconds=t.ttft_seconds,
                        total_seconds=t.total_seconds, checkpoints=list(t.checkpoints))
               for t in session.turns])


@router.get("/v1/rewind/sessions", response_model=SessionList)
async def list_sessions(request: Request) -> SessionList:
    """The client sessions this key sent (every key's for an admin key), most recent first."""
    book: SessionBook = request.app.state.sessions
    tenant, admin = request_tenant(request.scope)
    return SessionList(admin=admin, max_sessions=book.max_sessions,
                       data=[session_view(s) for s in book.visible(tenant, admin)])


def _tier(stats: Any) -> TierView | None:
    if not isinstance(stats, dict):
        return None
    return TierView(bytes=int(stats.get("bytes", 0)), budget_bytes=int(stats.get("budget_bytes") or 0),
                    entries=int(stats.get("entries", 0)), hits=int(stats.get("hits", 0)),
                    misses=int(stats.get("misses", 0)), evictions=int(stats.get("evictions", 0)),
                    persistent=bool(stats.get("persistent", False)),
                    bytes_written=int(stats.get("bytes_written", 0)))


def cache_view(pool: Any, caches: list[Any]) -> CacheView:
    """The tiers and the token counters of every model's prompt cache (`caches`)."""
    counters = dict.fromkeys(_CACHE_COUNTERS, 0)
    tiers: dict[str, Any] = pool.tiers.stats() if pool.tiers is not None else {}
    for cache in caches:
        stats = cache.stats()
        for key in counters:
            counters[key] += int(stats.get(key, 0))
        if not tiers:  # one model's own tiers (a server around one engine)
            tiers = {"ram": stats.get("ram"), "disk": stats.get("disk")}
    requested = counters["tokens_requested"]
    return CacheView(enabled=pool.config.engine.cache.enabled, ram=_tier(tiers.get("ram")),
                     disk=_tier(tiers.get("disk")), tokens_requested=requested,
                     tokens_restored_ram=counters["tokens_restored_ram"],
                     tokens_restored_disk=counters["tokens_restored_disk"],
                     tokens_recomputed=counters["tokens_recomputed"],
                     hit_rate=counters["tokens_restored"] / requested if requested else 0.0)


def status_view(pool: Any, cache: CacheView) -> StatusView:
    engine = pool.engine_stats()
    budget = pool.budget.stats()
    models = []
    for slot in pool.slots():
        described = pool.describe(slot)
        models.append(ModelView(**{key: described.get(key) for key in ModelView.model_fields
                                   if key in described}))
    return StatusView(
        time=time.time(), default_model=pool.default_model,
        requests=RequestsView(running=int(engine.get("running", 0)),
                              queued=int(engine.get("queued", 0)),
                              parallel=int(engine.get("parallel", 0)),
                              waiting_for_memory=int(budget.get("waiting", 0))),
        memory=MemoryView(**{key: int(budget.get(key) or 0) for key in MemoryView.model_fields}),
        cache=cache, models=models)


@router.get("/v1/rewind/status", response_model=StatusView)
async def status(request: Request) -> StatusView:
    """Tiers, hit rate, memory budget, running and waiting requests, models: server-wide."""
    pool = request.app.state.pool
    caches = [slot.prompt_cache for slot in pool.slots() if slot.prompt_cache is not None]
    # Off the event loop: a prompt cache's stats wait for its lock, which a restore from disk
    # holds on the engine thread.
    cache = await asyncio.to_thread(cache_view, pool, caches)
    return status_view(pool, cache)
