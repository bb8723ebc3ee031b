"""Several models in one server: load on the first request that names one, unload when idle.

A slot per servable model (aliases share one). A request takes a lease on its model's slot for
its whole life (the LeaseMiddleware gives it back when the response has been sent, streams
included), so an unload waits for exactly the requests that use the model. Loads and unloads run
one at a time (`_change`), the model's files are read on a worker thread, and every model's
engine is the existing Engine, created and shut down through its public API.

An engine that fails (a forward pass that raised: Engine._fail ends its requests with an error
and stops it) is restarted with its model: unloaded and loaded again, by the reaper within
REAPER_SECONDS, or by the next request for it, whichever comes first (`_recover`). Its prompt
cache is kept, as across any unload, so the restarted engine hits the same prefixes.

What an unload frees: the engine (its thread, live caches), the model's arrays, MLX's buffer
cache and glibc's free heap. What it keeps: the model's PromptCache (its partial-point index)
with the model detached; its records stay in the shared tiers, so a reload hits them.

Memory is measured around every load and unload (load_memory.py): a load reserves its peak and
is charged what it added, and an unload's memory counts as free once it is back with the OS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from rewind.config import ServerConfig
from rewind.engine.memory_budget import KvAccount
from rewind.engine.model_thread import ModelThread
from rewind.models.catalog import Catalog, Servable
from rewind.models.memory_estimate import kv_shape, loaded_bytes
from rewind.server.errors import ApiError
from rewind.server.keep_alive import parse_duration
from rewind.server.load_memory import (
    LoadMeter,
    load_peak,
    need_parts,
    release_freed,
    settle,
    tokenizer_bytes,
)
from rewind.server.memory_budget import MemoryBudget, gib
from rewind.server.metrics import ServerMetrics
from rewind.server.pool_slot import Slot, failed
from rewind.server.runtime import ModelRuntime
from rewind.server.shared_tokenizers import SharedTokenizers, tokenizer_key

log = logging.getLogger(__name__)

REAPER_SECONDS = 0.25
RECLAIM_SECONDS = 10.0  # how long a load that does not fit waits for freed memory to come back


class Lease:
    """A request's hold on a loaded model; released once its response has been sent."""

    def __init__(self, pool: ModelPool, slot: Slot, keep_alive: float | None,
                 fallback_note: str | None) -> None:
        self.pool = pool
        self.slot = slot
        self.runtime = slot.runtime
        self.keep_alive = keep_alive
        self.fallback_note = fallback_note
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._release(self)


class ModelPool:
    def __init__(self, catalog: Catalog, config: ServerConfig, metrics: ServerMetrics,
                 budget: MemoryBudget, tiers: Any = None, *, default_model: str | None = None,
                 max_models: int | None = None, idle_unload: float | None = None,
                 reserve_tokens: int = 4096, backend: str | None = None,
                 load_options: dict[str, Any] | None = None) -> None:
        self.catalog = catalog
        self.config = config
        self.metrics = metrics
        self.budget = budget
        self.tiers = tiers
        self.default_model = default_model or (catalog.names[0] if catalog.names else None)
        self.max_models = max_models
        self.idle_unload = idle_unload
        self.reserve_tokens = reserve_tokens
        self.load_options = load_options or {}
        if backend is None:
            from rewind.models.registry import current_backend

            backend = current_backend()
        self.backend = backend
        self._slots: dict[Path, Slot] = {}
        self._draft: Any = None  # the loaded draft model (ServerConfig.draft_model), once loaded
        self._tokenizers = SharedTokenizers()
        self._change: asyncio.Lock | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.started = time.time()

    # ---- slots -------------------------------------------------------------------------------

    def slot(self, name: str | None) -> Slot:
        """The slot a request's model name reaches; 404 listing the servable names."""
        name = name or self.default_model
        try:
            entry = self.catalog.lookup(name or "")
        except FileNotFoundError:
            raise ApiError(404, "not_found",
                           f"model {name!r} is not served here; this server serves: "
                           + ", ".join(self.catalog.names), param="model",
                           code="model_not_found") from None
        key = entry.path.resolve()
        if key not in self._slots:
            self._slots[key] = Slot(entry)
        return self._slots[key]

    def slots(self) -> list[Slot]:
        """A slot for every servable model, in the catalog's order."""
        return [self.slot(name) for name in self.catalog.names]

    def loaded(self) -> list[Slot]:
        return [slot for slot in self._slots.values() if slot.state in ("loaded", "unloading")]

    def _lock(self) -> asyncio.Lock:
        if self._change is None:
            self._change = asyncio.Lock()
        return self._change

    # ---- leases ------------------------------------------------------------------------------

    async def acquire(self, name: str | None, keep_alive: Any = None) -> Lease:
        try:
            alive = parse_duration(keep_alive)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc), param="keep_alive") from exc
        self._start_reaper()
        slot = self.slot(name)
        note = None
        while slot.state != "loaded" or failed(slot):
            if failed(slot):
                await self._recover(slot)
                continue
            served, note = await self.ensure_loaded(slot)
            slot = served
        slot.leases += 1
        slot.last_used = time.monotonic()
        slot.unload_at = None
        if slot.drained is not None:
            slot.drained.clear()
        return Lease(self, slot, alive, note)

    def _release(self, lease: Lease) -> None:
        slot = lease.slot
        slot.leases -= 1
        slot.last_used = time.monotonic()
        if lease.keep_alive is not None:
            slot.keep_alive = lease.keep_alive
        if slot.leases > 0:
            return
        if slot.drained is not None:
            slot.drained.set()
        alive = slot.keep_alive if slot.keep_alive is not None else self.idle_unload
        if alive is not None and alive >= 0 and not slot.pinned and slot.state == "loaded":
            slot.unload_at = slot.last_used + alive
            if alive == 0:
                asyncio.get_running_loop().create_task(self._unload_if_due(slot))

    def start(self) -> None:
        """On the server's event loop: start the idle / keep_alive clock."""
        self._start_reaper()

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAPER_SECONDS)
            for slot in list(self._slots.values()):
                if failed(slot):
                    try:
                        await self._recover(slot)
                    except Exception:  # noqa: BLE001 - the next request for it tries again
                        log.exception("restarting the engine of %s failed", slot.name)
                if slot.unload_at is not None and time.monotonic() >= slot.unload_at:
                    await self._unload_if_due(slot)

    async def _recover(self, slot: Slot) -> None:
        """Restart a failed engine with its model: a model this pool loaded is unloaded (once
        the responses of its failed requests are out) and loaded again, so nothing the failure
        may have left behind (the runner's and kernels' state, the model's arrays) is reused; an
        engine the caller owns (pinned) is restarted over the same model (Engine.restart)."""
        async with self._lock():
            if not failed(slot):
                return  # restarted meanwhile
            log.warning("restarting the engine of %s with its model after a failure (%s)",
                        slot.name, slot.engine.failure)
            slot.restarts += 1
            if slot.pinned:
                await asyncio.to_thread(slot.engine.restart)
                return
            await self._unload(slot, "engine_failed")
            await self._make_room(slot)
            await self._load(slot)

    async def _unload_if_due(self, slot: Slot) -> None:
        async with self._lock():
            due = slot.unload_at is not None and time.monotonic() >= slot.unload_at
            if due and slot.leases == 0 and slot.state == "loaded":
                await self._unload(slot, "keep_alive" if slot.keep_alive is not None
                                   else "idle")

    # ---- load --------------------------------------------------------------------------------

    def need_of(self, entry: Servable) -> int:
        """Bytes `entry` needs loaded: weights (measured once loaded before) + tokenizer +
        KV for --parallel slots of `reserve_tokens`."""
        weights, reserve = self._need_parts(entry)
        return weights + reserve

    def load_need_of(self, entry: Servable) -> int:
        """Bytes a load of `entry` must find free: its peak while loading (at least what it
        keeps) and its KV reserve. Measured on an earlier load, estimated before the first."""
        weights, reserve = self._need_parts(entry)
        return self._load_peak(entry, weights) + reserve

    def _load_peak(self, entry: Servable, weights: int) -> int:
        return load_peak(entry, self._slots.get(entry.path.resolve()), weights)

    def _need_parts(self, entry: Servable) -> tuple[int, int]:
        return need_parts(entry, self._slots.get(entry.path.resolve()), self.backend,
                          self.config.engine.parallel, self.reserve_tokens)

    async def ensure_loaded(self, slot: Slot) -> tuple[Slot, str | None]:
        """Load `slot` (or a smaller form of it that fits); returns the slot that serves."""
        async with self._lock():
            if slot.state == "loaded":
                return slot, None
            slot, note = self._fit_or_fallback(slot)
            if slot.state == "loaded":
                return slot, note
            await self._make_room(slot)
            await self._load(slot)
            return slot, note

    def _fit_or_fallback(self, slot: Slot) -> tuple[Slot, str | None]:
        need = self.load_need_of(slot.entry)
        room = self.budget.alone_room()
        if need <= room:
            return slot, None
        smaller = [(self.load_need_of(form), form) for form in self.catalog.forms_of(slot.entry)]
        fitting = sorted((n, form) for n, form in smaller if n <= room)
        if fitting:
            form_need, form = fitting[-1]
            note = (f"{form.name} ({form.form}) served for {slot.name} ({slot.entry.form}): "
                    f"{slot.name} needs {gib(need)}, the memory budget is "
                    f"{gib(self.budget.total)}")
            log.warning("memory budget: %s", note)
            self.budget.actions["fallback"] += 1
            slot.fallbacks += 1
            return self.slot(form.name), note
        self.budget.actions["refuse_load"] += 1
        raise ApiError(400, "invalid_request",
                       f"model {slot.name!r} needs {gib(need)} (its load's peak and the KV cache of "
                       f"{self.config.engine.parallel} sequences of {self.reserve_tokens} "
                       f"tokens), more than the memory budget allows: {gib(self.budget.total)} "
                       f"(--memory-budget), of which {gib(max(0, room))} is left for models; "
                       "no smaller form of it is here (try `rewind convert` to a q4 form, or "
                       "a larger --memory-budget)", param="model", code="insufficient_memory")

    async def _make_room(self, slot: Slot) -> None:
        """Unload other models, least recently used first (idle ones before busy ones, whose
        requests an unload waits for), until `slot` fits the budget and --max-models.
        RSS is sampled first, so memory the accounting does not explain counts against the room."""
        need = self.load_need_of(slot.entry)
        await asyncio.to_thread(settle, 1)
        while True:
            others = [s for s in self.loaded() if s is not slot and not s.pinned]
            over_count = self.max_models is not None and len(self.loaded()) >= self.max_models
            fits = need <= self.budget.free_for_load()
            if fits and not over_count:
                return
            if not others:
                if over_count and not fits:
                    break
                if fits:
                    return  # only pinned models hold the count
                break
            victim = min(others, key=lambda s: (s.leases > 0, s.last_used))
            self.budget.actions["unload_lru"] += 1
            log.info("unloading %s (least recently used) to load %s", victim.name, slot.name)
            await self._unload(victim, "lru")
        # Everything that could go has gone and it still does not fit: memory an unload freed
        # can come back late (a just-finished request's objects still held the model's arrays
        # when it ran; seen once in the churn benchmark as a 2 GiB baseline). Give it a moment.
        deadline = time.monotonic() + RECLAIM_SECONDS
        while need > self.budget.free_for_load() and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            await asyncio.to_thread(settle, 1)
            self.budget.observe()
        if need > self.budget.free_for_load():
            log.warning("memory budget: %s needs %s; %s is free (RSS %s)", slot.name, gib(need),
                        gib(self.budget.free_for_load()), gib(self.budget.rss))
            raise ApiError(503, "overloaded",
                           f"model {slot.name!r} needs {gib(need)}; the memory budget "
                           f"({gib(self.budget.total)}) is held by running sequences",
                           code="insufficient_memory", headers={"Retry-After": "5"})

    async def _load(self, slot: Slot) -> None:
        slot.state = "loading"
        started = time.perf_counter()
        weights, _ = self._need_parts(slot.entry)
        self.budget.begin_load(slot.name, self._load_peak(slot.entry, weights))
        try:
            await asyncio.to_thread(self._load_blocking, slot)
        except ApiError:
            slot.state = "unloaded"
            raise
        except Exception as exc:
            slot.state = "unloaded"
            log.exception("loading %s failed", slot.name)
            raise ApiError(500, "server", f"loading model {slot.name!r} failed: "
                           f"{type(exc).__name__}: {exc}", code="model_load_failed") from exc
        finally:
            self.budget.end_load(slot.name)
        slot.load_seconds = time.perf_counter() - started
        slot.loads += 1
        slot.state = "loaded"
        self.budget.set_model(slot.name, *self._need_parts(slot.entry))
        self.budget.observe()
        log.info("loaded %s in %.2f s (%s kept, %s at its peak)", slot.name, slot.load_seconds,
                 gib(slot.loaded_bytes), gib(slot.peak_bytes))

    def load_now(self, name: str | None) -> Slot:
        """Load at start, before the event loop runs (the first --model)."""
        slot = self.slot(name)
        slot, _ = self._fit_or_fallback(slot)
        started = time.perf_counter()
        self.budget.begin_load(slot.name, self._load_peak(slot.entry,
                                                          self._need_parts(slot.entry)[0]))
        try:
            self._load_blocking(slot)
        finally:
            self.budget.end_load(slot.name)
        slot.load_seconds = time.perf_counter() - started
        slot.loads += 1
        slot.state = "loaded"
        slot.last_used = time.monotonic()
        if self.idle_unload is not None and self.idle_unload >= 0:
            slot.unload_at = slot.last_used + self.idle_unload  # unused since start
        self.budget.set_model(slot.name, *self._need_parts(slot.entry))
        self.budget.observe()
        return slot

    def _load_blocking(self, slot: Slot) -> None:
        from rewind.engine import Engine
        from rewind.models.loader import load_model
        from rewind.models.registry import resolve_model

        meter = LoadMeter()
        entry = slot.entry
        path = resolve_model(entry.name) if entry.kind == "default" else entry.path
        if path.is_file():  # a GGUF: converted once to bf16 (rewind.models.registry)
            path = resolve_model(str(path))
        key = tokenizer_key(path)
        shared = key in self._tokenizers
        loaded = load_model(str(path), tokenizer=self._tokenizers.get(key),
                            **self.load_options)
        loaded.name = entry.name
        self._tokenizers.take(key, loaded.tokenizer)
        slot.tokenizer_key = key
        cache = slot.prompt_cache
        if cache is not None and cache.fingerprint != loaded.fingerprint:
            cache.close()  # the files changed: the old records answer for nothing
            cache = None
        if cache is None and self.config.engine.cache.enabled:
            from rewind.cache.prompt_cache import PromptCache

            cache = PromptCache(loaded.model, loaded.fingerprint, self.config.engine.cache,
                                tiers=self.tiers)
        elif cache is not None:
            cache.model = loaded.model
        slot.prompt_cache = cache
        # The warm-up's engine and the serving one run on one thread: MLX keeps what the
        # warm-up builds (compiled steps, cuDNN and CUDA graphs) per thread.
        thread = slot.thread = ModelThread(f"rewind-{entry.name}")
        try:
            if self.config.warm_up and self.backend != "cpu":
                from rewind.engine.warm_up import warm_up

                slot.warm_up_seconds = warm_up(loaded, self.config.engine,
                                               self.config.engine.cache, thread).seconds
            element = 4 if self.backend == "cpu" else 2
            kv = kv_shape(loaded.config, element)
            # The engine's scheduler grows each sequence's room in the budget before its tokens.
            memory = None if kv is None else KvAccount(self.budget, kv, str(loaded.name))
            engine = Engine(loaded, self.config.engine, cache, memory,
                            draft=self._draft_for(loaded), thread=thread).start()
        except BaseException:
            thread.close()
            slot.thread = None
            raise
        slot.engine = engine
        slot.runtime = ModelRuntime(loaded, engine, self.config, self.metrics, cache,
                                    self.budget, kv)
        meter.charge(slot, loaded_bytes(loaded.model) + (0 if shared else tokenizer_bytes(path)))

    def _draft_for(self, loaded: Any) -> Any:
        """The draft model (loaded once, on the first model's load) where it can draft for
        `loaded`; None where none is set or its vocabulary differs (that model decodes without
        it, said in the log)."""
        if not self.config.draft_model:
            return None
        from rewind.engine.draft_model import DraftModelError, check_compatible
        from rewind.models.loader import load_model
        from rewind.models.registry import resolve_model

        if self._draft is None:
            self._draft = load_model(str(resolve_model(self.config.draft_model)),
                                     **self.load_options)
            log.info("loaded the draft model %s", self.config.draft_model)
        try:
            check_compatible(loaded, self._draft)
        except DraftModelError as exc:
            log.warning("%s decodes without the draft model: %s", loaded.name, exc)
            return None
        return self._draft

    def adopt(self, loaded: Any, engine: Any, prompt_cache: Any = None) -> Slot:
        """Serve a model and engine the caller loaded and owns (never unloaded here)."""
        slot = self.slot(loaded.name)
        slot.engine = engine
        slot.prompt_cache = prompt_cache
        slot.pinned = True
        slot.state = "loaded"
        slot.loads = 1
        slot.loaded_bytes = loaded_bytes(loaded.model)
        slot.runtime = ModelRuntime(loaded, engine, self.config, self.metrics, prompt_cache)
        return slot

    # ---- unload ------------------------------------------------------------------------------

    async def unload(self, name: str) -> Slot:
        """POST /v1/models/unload: waits for the model's running requests."""
        slot = self.slot(name)
        if slot.pinned:
            raise ApiError(400, "invalid_request", f"model {slot.name!r} was handed to this "
                           "server loaded and cannot be unloaded", param="model")
        async with self._lock():
            if slot.state == "loaded":
                await self._unload(slot, "request")
        return slot

    async def load(self, name: str, keep_alive: Any = None) -> Slot:
        """POST /v1/models/load: load and keep (for keep_alive, or the server's idle time)."""
        lease = await self.acquire(name, keep_alive)
        lease.release()
        return lease.slot

    async def _unload(self, slot: Slot, reason: str) -> None:
        slot.state = "unloading"
        slot.unload_at = None
        if slot.leases > 0:
            if slot.drained is None:
                slot.drained = asyncio.Event()
            slot.drained.clear()
            while slot.leases > 0:  # new leases cannot start: the state is "unloading"
                await slot.drained.wait()
                slot.drained.clear()
        await asyncio.to_thread(self._unload_blocking, slot)
        await asyncio.to_thread(settle)
        slot.state = "unloaded"
        slot.unloads[reason] += 1
        slot.keep_alive = None
        self.budget.drop_model(slot.name)
        rss = self.budget.observe()  # what was not handed back counts as baseline
        log.info("unloaded %s (%s); RSS now %s", slot.name, reason, gib(rss))

    def _unload_blocking(self, slot: Slot) -> None:
        if slot.engine is not None:
            slot.engine.shutdown()
        if slot.thread is not None:
            slot.thread.close()
            slot.thread = None
        if slot.prompt_cache is not None:
            slot.prompt_cache.model = None  # records stay in the shared tiers
        slot.engine = None
        slot.runtime = None
        if slot.tokenizer_key is not None:
            self._tokenizers.give_back(slot.tokenizer_key)
            slot.tokenizer_key = None
        release_freed()

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for slot in self.loaded():
            if not slot.pinned:
                await asyncio.to_thread(self._unload_blocking, slot)
                slot.state = "unloaded"

    def close_blocking(self) -> None:
        """At exit (any thread): stop every engine this pool started, close the caches."""
        for slot in list(self._slots.values()):
            if slot.pinned:
                continue
            if slot.engine is not None:
                slot.engine.shutdown()
                slot.engine = None
            if slot.thread is not None:
                slot.thread.close()
                slot.thread = None
            if slot.prompt_cache is not None:
                slot.prompt_cache.close()
        if self.tiers is not None:
            self.tiers.close()

    # ---- observation -------------------------------------------------------------------------

    def healthy(self) -> bool:
        return all(getattr(slot.engine, "alive", True) for slot in self.loaded())

    def engine_stats(self) -> dict[str, Any]:
        """The engines' stats summed (what /metrics' server-wide gauges show)."""
        import mlx.core as mx

        total: dict[str, Any] = {"running": 0, "queued": 0, "parallel": 0}
        for slot in self.loaded():
            if slot.engine is not None:
                stats = slot.engine.stats()
                for key in total:
                    total[key] += stats.get(key, 0)
        total.update(mlx_active_bytes=mx.get_active_memory(), mlx_peak_bytes=mx.get_peak_memory(),
                     mlx_cache_bytes=mx.get_cache_memory())
        return total

    def describe(self, slot: Slot) -> dict[str, Any]:
        entry = slot.entry
        out: dict[str, Any] = {
            "id": entry.name, "object": "model", "created": int(self.started),
            "owned_by": "rewind", "context_length": entry.context_length,
            "loaded": slot.state == "loaded", "state": slot.state, "form": entry.form,
            "kind": entry.kind, "size_bytes": entry.size_bytes, "path": str(entry.path),
            "aliases": list(entry.aliases),
        }
        if slot.runtime is not None:
            out["context_length"] = slot.runtime.context_length
        if slot.state in ("loaded", "unloading"):
            out["memory_bytes"] = slot.loaded_bytes
            out["running"] = slot.leases
            out["load_seconds"] = round(slot.load_seconds, 3)
            if slot.warm_up_seconds is not None:
                out["warm_up_seconds"] = round(slot.warm_up_seconds, 3)
            out["engine_restarts"] = slot.restarts
            if slot.unload_at is not None:
                out["unload_in_seconds"] = round(max(0.0, slot.unload_at - time.monotonic()), 1)
        return out
