"""The pools a server runs: `rewind serve`'s (shared cache tiers, a memory budget measured from
the process's baseline) and a pool of one model its caller already loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rewind.config import ServerConfig
from rewind.models.catalog import Catalog
from rewind.server.memory_budget import MemoryBudget
from rewind.server.metrics import ServerMetrics
from rewind.server.model_pool import ModelPool


def single_model_pool(loaded: Any, engine: Any, config: ServerConfig,
                      prompt_cache: Any = None) -> ModelPool:
    """A pool of one model the caller loaded and owns (tests, embedders of create_app)."""
    from rewind.models.catalog import describe

    path = Path(loaded.path)
    aliases = tuple(dict.fromkeys(a for a in (path.name, str(path)) if a != str(loaded.name)))
    entry = describe(str(loaded.name), path, "local", aliases)
    metrics = ServerMetrics(engine.stats, prompt_cache.stats if prompt_cache is not None else None)
    budget = MemoryBudget(1 << 62)  # the caller sized it; nothing is loaded or unloaded here
    pool = ModelPool(Catalog.fixed([entry]), config, metrics, budget, backend="cpu")
    pool.adopt(loaded, engine, prompt_cache)
    _register_gauges(pool)
    return pool


def _register_gauges(pool: ModelPool) -> None:
    from rewind.server.pool_metrics import PoolGauges

    pool.metrics.registry.register(PoolGauges(pool))


def build_pool(catalog: Catalog, config: ServerConfig, budget_bytes: int, **options: Any
               ) -> ModelPool:
    """The pool `rewind serve` runs: one RAM tier and scratch file for every model's prompt
    cache, the budget's baseline measured now (before any model)."""
    import psutil

    tiers = None
    if config.engine.cache.enabled:
        from rewind.cache.shared_tiers import SharedTiers

        tiers = SharedTiers(config.engine.cache)
    base = psutil.Process().memory_info().rss
    budget = MemoryBudget(budget_bytes, tiers, max_waiting=config.engine.max_queue,
                          base_bytes=base)
    pool_ref: list[ModelPool] = []
    metrics = ServerMetrics(lambda: pool_ref[0].engine_stats(),
                            tiers.stats if tiers is not None else None)
    pool = ModelPool(catalog, config, metrics, budget, tiers, **options)
    pool_ref.append(pool)
    _register_gauges(pool)
    return pool
