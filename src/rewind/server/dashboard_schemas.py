"""What /v1/rewind/sessions and /v1/rewind/status answer (the web page's data), declared so
/openapi.json describes them."""

from __future__ import annotations

from pydantic import BaseModel


class TurnView(BaseModel):
    at: float  # unix time the turn finished
    model: str
    api: str
    outcome: str
    prompt_tokens: int
    completion_tokens: int
    ram_tokens: int
    disk_tokens: int
    recomputed_tokens: int
    ttft_seconds: float
    total_seconds: float
    checkpoints: list[int]


class SessionTotals(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    ram_tokens: int
    disk_tokens: int
    recomputed_tokens: int


class SessionView(BaseModel):
    id: str
    tenant: str
    source: str  # "prefix" (grouped by the cache's prefix chain) or "header" (named by the client)
    model: str
    anchor_tokens: int
    started: float
    last_seen: float
    turn_count: int
    totals: SessionTotals
    turns: list[TurnView]  # the most recent turns, oldest first


class SessionList(BaseModel):
    object: str = "list"
    admin: bool  # whether every tenant's sessions are listed
    max_sessions: int
    data: list[SessionView]


class RequestsView(BaseModel):
    running: int
    queued: int
    parallel: int
    waiting_for_memory: int


class MemoryView(BaseModel):
    budget_bytes: int
    committed_bytes: int
    base_bytes: int
    models_bytes: int
    loading_bytes: int
    live_kv_bytes: int
    ram_tier_bytes: int
    rss_bytes: int


class TierView(BaseModel):
    bytes: int
    budget_bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    persistent: bool = False
    bytes_written: int = 0


class CacheView(BaseModel):
    enabled: bool
    ram: TierView | None
    disk: TierView | None
    tokens_requested: int
    tokens_restored_ram: int
    tokens_restored_disk: int
    tokens_recomputed: int
    hit_rate: float  # prompt tokens restored / prompt tokens asked for (0 before any)


class ModelView(BaseModel):
    id: str
    state: str
    loaded: bool
    size_bytes: int | None = None
    memory_bytes: int | None = None
    running: int | None = None
    context_length: int | None = None
    unload_in_seconds: float | None = None


class StatusView(BaseModel):
    time: float
    default_model: str | None
    requests: RequestsView
    memory: MemoryView
    cache: CacheView
    models: list[ModelView]
