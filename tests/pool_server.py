"""`rewind serve`'s model pool on loopback, in this process: tiny models served by name.

REWIND_HOME and HF_HUB_CACHE point into the test's folder, so the catalog holds only what the
test puts there (its --model folders, converted forms, hub-cache repos), never the real default.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from live_server import Live, serve_on_free_port


@contextmanager
def pool_server(models: list[str], scratch: Path, *, budget: int = 1 << 40, parallel: int = 2,
                max_queue: int = 16, **options: Any) -> Iterator[tuple[Live, Any]]:
    """(live server, its ModelPool); the first of `models` is loaded at start."""
    from rewind.config import CacheConfig, EngineConfig, ServerConfig
    from rewind.models.catalog import Catalog
    from rewind.server.app import create_pool_app
    from rewind.server.pool_setup import build_pool

    cache = CacheConfig(cache_dir=scratch, disk_bytes=64 << 20)
    config = ServerConfig(model=models[0], engine=EngineConfig(parallel=parallel,
                                                               max_queue=max_queue, cache=cache))
    pool = build_pool(Catalog(models), config, budget, default_model=models[0], **options)
    pool.load_now(models[0])
    app = create_pool_app(pool, config)
    url, server, thread = serve_on_free_port(app)
    live = Live(url, None, None, models[0], server, thread)
    try:
        yield live, pool
    finally:
        live.stop()
        pool.close_blocking()


def models_by_id(live: Live) -> dict[str, dict[str, Any]]:
    answer = httpx.get(f"{live.url}/v1/models", timeout=30)
    assert answer.status_code == 200, answer.text
    return {model["id"]: model for model in answer.json()["data"]}


def metric(live: Live, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{wanted}}}" if wanted else name):
            return float(value)
    return 0.0
