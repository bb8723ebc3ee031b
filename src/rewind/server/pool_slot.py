"""One servable model's place in the pool (rewind.server.model_pool): its state, its engine and
what its loads were measured to take."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rewind.models.catalog import Servable
from rewind.server.runtime import ModelRuntime


@dataclass
class Slot:
    entry: Servable
    state: str = "unloaded"  # unloaded | loading | loaded | unloading
    runtime: ModelRuntime | None = None
    prompt_cache: Any = None  # kept across unloads
    engine: Any = None
    thread: Any = None  # the model's ModelThread (rewind.engine.model_thread) while loaded
    pinned: bool = False  # an engine the caller owns (create_app(loaded, engine)): never unloaded
    leases: int = 0
    last_used: float = 0.0
    keep_alive: float | None = None  # the last request's keep_alive (None: the server's)
    unload_at: float | None = None
    loaded_bytes: int = 0  # charged while loaded: max(estimate, measured RSS rise of its load)
    peak_bytes: int = 0  # the RSS rise its last load reached at its peak (0: never loaded)
    tokenizer_key: str | None = None
    loads: int = 0
    load_seconds: float = 0.0
    warm_up_seconds: float | None = None  # the last load's warm-up (None: none ran)
    unloads: Counter[str] = field(default_factory=Counter)
    fallbacks: int = 0
    restarts: int = 0  # engines restarted after a failure
    drained: asyncio.Event | None = None

    @property
    def name(self) -> str:
        return self.entry.name


def failed(slot: Slot) -> bool:
    """Whether the slot's engine stopped after a failure and waits for a restart."""
    return (slot.state == "loaded" and slot.engine is not None
            and getattr(slot.engine, "failure", None) is not None)
