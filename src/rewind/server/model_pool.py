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

Memory is measured around every load and unload, because estimates alone let the process cross
its budget (4.46 GiB RSS under a 3.51 GiB budget in the churn benchmark): a load reserves its
peak, not just what it keeps (first load: an estimate; then the peak it was measured to reach),
is charged the larger of its estimate and the RSS it added, and an unload waits until the freed
memory is back with the OS before the budget counts it free (`_settle`).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewind.config import ServerConfig
from rewind.models.catalog import Catalog, Servable
from rewind.models.memory_estimate import estimate_need, kv_shape, loaded_bytes
from rewind.server.errors import ApiError
from rewind.server.memory_budget import MemoryBudget, gib
from rewind.server.metrics import ServerMetrics
from rewind.server.runtime import ModelRuntime

log = logging.getLogger(__name__)

REAPER_SECONDS = 0.25
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json")
# The tokenizer's share of a loaded model beyond its weights (parsed vocabulary, merges):
# measured ~6x tokenizer.json for Gemma 3's 262k-token one (33 MB file, ~195 MB resident).
TOKENIZER_FACTOR = 6
# A first load's peak above its header estimate, before it has been measured: half its weight
# files plus the tokenizer's parse once more (the JSON text and the half-built vocabulary are
# freed only after it is done). Measured peaks over the estimate: +0.23 GiB (default, 0.5 GiB
# bf16 file), +0.27 (1B-shaped llama, 1.8 GiB), +0.53 (the default in float32, 1.0 GiB: the CPU
# head's bf16 copy, which headers cannot show). Conservative on purpose: from the second load
# on, the measured peak replaces it.
LOAD_FILE_FRACTION = 2
# A measured peak is reserved with this share on top: loads of the same files peak a few MB
# apart (what the last load left in the heap, page alignment); the churn benchmark without it
# came within 2.7 MB of its budget.
LOAD_PEAK_MARGIN = 32  # 1/32: +67 MB on the 1B-shaped llama's 2.1 GB peak
# An unload's memory is counted free only once RSS stops falling by more than this per try.
SETTLE_BYTES = 8 << 20
SETTLE_TRIES = 5
RECLAIM_SECONDS = 10.0  # how long a load that does not fit waits for freed memory to come back


def parse_duration(value: Any) -> float | None:
    """Ollama's keep_alive: seconds as a number, or '30s', '15m', '2h', '1h30m'; negative means
    forever (returned as -1); None -> None (the server's default)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return -1.0 if value < 0 else float(value)
    text = str(value).strip().lower()
    if not text:
        return None
    try:
        number = float(text)
        return -1.0 if number < 0 else number
    except ValueError:
        pass
    total, digits, negative = 0.0, "", text.startswith("-")
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    rest = text.lstrip("-")
    index = 0
    while index < len(rest):
        char = rest[index]
        if char.isdigit() or char == ".":
            digits += char
            index += 1
            continue
        unit = "ms" if rest.startswith("ms", index) else char
        if unit not in units or not digits:
            raise ValueError(f"not a duration: {value!r} (try 30s, 15m, 2h, 0 or -1)")
        total += float(digits) * units[unit]
        digits = ""
        index += len(unit)
    if digits:
        raise ValueError(f"not a duration: {value!r} (a unit is missing: 30s, 15m, 2h)")
    return -1.0 if negative else total


@dataclass
class Slot:
    entry: Servable
    state: str = "unloaded"  # unloaded | loading | loaded | unloading
    runtime: ModelRuntime | None = None
    prompt_cache: Any = None  # kept across unloads
    engine: Any = None
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
    unloads: Counter[str] = field(default_factory=Counter)
    fallbacks: int = 0
    restarts: int = 0  # engines restarted after a failure
    drained: asyncio.Event | None = None

    @property
    def name(self) -> str:
        return self.entry.name


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
        self._tokenizers: dict[str, tuple[Any, int]] = {}  # key -> (tokenizer, users)
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
        while slot.state != "loaded" or _failed(slot):
            if _failed(slot):
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
                if _failed(slot):
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
            if not _failed(slot):
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
        slot = self._slots.get(entry.path.resolve())
        if slot is not None and slot.peak_bytes:
            return max(slot.peak_bytes + slot.peak_bytes // LOAD_PEAK_MARGIN, weights)
        if not entry.path.exists():
            return weights
        files = entry.path.glob("*.safetensors") if entry.path.is_dir() else [entry.path]
        file_bytes = sum(file.stat().st_size for file in files)
        return weights + file_bytes // LOAD_FILE_FRACTION + self._tokenizer_bytes(entry.path)

    def _need_parts(self, entry: Servable) -> tuple[int, int]:
        if not entry.path.exists():
            return 0, 0  # the default, not converted yet: known once converted
        need = estimate_need(entry.path, self.backend, self.config.engine.parallel,
                             self.reserve_tokens, entry.context_length)
        slot = self._slots.get(entry.path.resolve())
        weights = slot.loaded_bytes if slot is not None and slot.loaded_bytes else (
            need.weights_bytes + self._tokenizer_bytes(entry.path))
        return weights, need.reserve_bytes

    @staticmethod
    def _tokenizer_bytes(path: Path) -> int:
        file = path / "tokenizer.json" if path.is_dir() else None
        return TOKENIZER_FACTOR * file.stat().st_size if file is not None and file.exists() else 0

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
        await asyncio.to_thread(self._settle, 1)
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
            await asyncio.to_thread(self._settle, 1)
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
        from rewind.memory import PeakRss, process_rss
        from rewind.models.loader import load_model
        from rewind.models.registry import resolve_model

        before = process_rss()
        peak = PeakRss()
        entry = slot.entry
        path = resolve_model(entry.name) if entry.kind == "default" else entry.path
        if path.is_file():  # a GGUF: converted once to bf16 (rewind.models.registry)
            path = resolve_model(str(path))
        key = _tokenizer_key(path)
        shared = self._tokenizers.get(key)
        loaded = load_model(str(path), tokenizer=shared[0] if shared else None,
                            **self.load_options)
        loaded.name = entry.name
        self._tokenizers[key] = (loaded.tokenizer, (shared[1] if shared else 0) + 1)
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
        engine = Engine(loaded, self.config.engine, cache).start()
        element = 4 if self.backend == "cpu" else 2
        kv = kv_shape(loaded.config, element)
        slot.engine = engine
        slot.runtime = ModelRuntime(loaded, engine, self.config, self.metrics, cache,
                                    self.budget, kv)
        estimate = loaded_bytes(loaded.model) + (0 if shared else self._tokenizer_bytes(path))
        # What the OS saw: the RSS the load added (its arrays, its tokenizer, the engine's
        # thread and set-up, kernels' copies outside MLX) and the highest it went meanwhile.
        # Loads run one at a time; a request on another model running meanwhile can only make
        # these larger, which errs on the safe side.
        kept = process_rss() - before
        slot.loaded_bytes = max(estimate, kept)
        slot.peak_bytes = max(peak.peak() - before, slot.loaded_bytes)

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
        await asyncio.to_thread(self._settle)
        slot.state = "unloaded"
        slot.unloads[reason] += 1
        slot.keep_alive = None
        self.budget.drop_model(slot.name)
        rss = self.budget.observe()  # what was not handed back counts as baseline
        log.info("unloaded %s (%s); RSS now %s", slot.name, reason, gib(rss))

    def _settle(self, tries: int = SETTLE_TRIES) -> int:
        """Hand freed memory back (garbage, MLX's buffer cache, glibc's free heap) until RSS stops
        falling: the budget then sees what an unload really freed, and the next load is admitted
        against that, not against what the accounting hopes. Returns the RSS."""
        import mlx.core as mx

        from rewind.memory import process_rss, release_free_heap

        last = process_rss()
        for _ in range(tries):
            gc.collect()
            mx.clear_cache()
            release_free_heap(collect=False)
            now = process_rss()
            if last - now < SETTLE_BYTES:
                return now
            last = now
            time.sleep(0.02)
        return last

    def _unload_blocking(self, slot: Slot) -> None:
        import mlx.core as mx

        from rewind.memory import release_free_heap

        if slot.engine is not None:
            slot.engine.shutdown()
        if slot.prompt_cache is not None:
            slot.prompt_cache.model = None  # records stay in the shared tiers
        slot.engine = None
        slot.runtime = None
        if slot.tokenizer_key is not None:
            tokenizer, users = self._tokenizers.pop(slot.tokenizer_key, (None, 1))
            if users > 1:
                self._tokenizers[slot.tokenizer_key] = (tokenizer, users - 1)
            slot.tokenizer_key = None
        gc.collect()
        mx.clear_cache()
        release_free_heap(collect=False)

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
            out["engine_restarts"] = slot.restarts
            if slot.unload_at is not None:
                out["unload_in_seconds"] = round(max(0.0, slot.unload_at - time.monotonic()), 1)
        return out


def _failed(slot: Slot) -> bool:
    """Whether the slot's engine stopped after a failure and waits for a restart."""
    return (slot.state == "loaded" and slot.engine is not None
            and getattr(slot.engine, "failure", None) is not None)


def _tokenizer_key(path: Path) -> str:
    """Folders whose tokenizer files are the same bytes share one loaded tokenizer."""
    digest = hashlib.blake2b(digest_size=16)
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    config = path / "config.json"
    if config.is_file():  # the EOS ids load_tokenizer reads from it
        import json

        digest.update(repr(json.loads(config.read_text()).get("eos_token_id")).encode())
    return digest.hexdigest()



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
