"""The memory budget: loaded weights + live KV caches + the prompt cache's RAM tier, under one cap.

Accounting checked against the OS: each loaded model counts the larger of its estimate and the
RSS its load actually added (the model pool measures it), plus a reserve for its sequences'
caches (--parallel slots of --kv-reserve-tokens); each live sequence the bytes its cache holds at
its token count (KvShape; a model's sequences fill its reserve first, then take room beyond it);
the RAM tier its records' bytes; a load in progress its measured (or estimated) peak, which is
above what it keeps: files read before the cast, a tokenizer parsed; and the process its
baseline.

The baseline is sampled, not assumed: at each load and unload (`observe`) whatever RSS the
accounting does not explain (modules imported by a first load, heap or MLX cache not handed back
yet) is counted as baseline, never less than what the process held before any model. Sampling
alone would see a sequence only after it crossed the line; accounting alone missed 0.95 GiB of
load temporaries and retained heap in `rewind bench model-switch`'s churn.

Who asks, and when (so a sequence is accounted before its tokens are made, on every path that
runs an engine):
  - the scheduler admits a sequence only with a ticket for its prompt (`KvAccount.reserve`; the
    server takes it before submitting, where it can answer 429 or wait: rewind.server.
    memory_budget.admit), and grows each decoding row's ticket before the step that makes its
    next token (and its drafted ones);
  - the model pool asks for room before a load (`free_for_load`).
When room runs short it acts in this order:
  1. the RAM tier shrinks (its records spill to the disk tier: they cost a read, not a recompute);
  2. a new sequence waits for room (429 with Retry-After once --max-queue are waiting);
  3. a running sequence that would cross the budget is ended with finish_reason "length".
Tickets are taken and grown on the engine thread and the event loop; hence the lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rewind.models.memory_estimate import KvShape

log = logging.getLogger(__name__)

GUARD_ACTIONS = ("ram_spill", "wait", "reject_429", "cut_length", "unload_lru", "fallback",
                 "refuse_load", "refuse_prompt", "wait_timeout", "wait_abandoned")


# How long a sequence waits for room at the server's door before a 503: long enough for running
# ones to finish a typical answer, short enough that a client is told rather than left hanging
# (their own timeouts are often 60 s or more; then they retry after Retry-After).
MAX_WAIT_SECONDS = 30.0


def gib(value: int) -> str:
    return f"{value / (1 << 30):.2f} GiB"


class NeverFits(Exception):
    """A sequence whose cache cannot fit even with nothing else running beside its model."""

    def __init__(self, need: int, room: int, tokens: int, model: str, total: int) -> None:
        super().__init__(f"this prompt's cache needs {gib(need)} ({tokens} tokens on {model!r}); "
                         f"the memory budget ({gib(total)}, --memory-budget) leaves "
                         f"{gib(max(0, room))} beside the loaded models")
        self.need, self.room = need, room


class Ticket:
    """One sequence's share of the budget: the bytes of its cache at its current length."""

    def __init__(self, budget: MemoryBudget, kv: KvShape, tokens: int, model: str) -> None:
        self.budget = budget
        self.kv = kv
        self.tokens = tokens
        self.bytes = kv.bytes_for(tokens)
        self.model = model
        self.released = False

    def grow(self, tokens: int = 1) -> bool:
        """Account `tokens` more; False (nothing changed) when that would cross the budget."""
        wanted = self.kv.bytes_for(self.tokens + tokens)
        if wanted > self.bytes and not self.budget._extend(self, wanted - self.bytes):
            return False
        self.tokens += tokens
        return True

    def grow_to(self, tokens: int) -> bool:
        """Cover `tokens` in all (nothing to do when it already does); False when that would
        cross the budget."""
        return tokens <= self.tokens or self.grow(tokens - self.tokens)

    def count_cut(self) -> None:
        """Its sequence was ended with finish_reason length for want of room."""
        with self.budget._lock:
            self.budget.actions["cut_length"] += 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget._release(self)


class MemoryBudget:
    def __init__(self, total_bytes: int, tiers: Any = None, max_waiting: int = 64,
                 base_bytes: int = 0) -> None:
        self.total = int(total_bytes)
        self.tiers = tiers  # rewind.cache.shared_tiers.SharedTiers, or None
        self.max_waiting = max_waiting
        self.max_wait_seconds = MAX_WAIT_SECONDS
        self.base = int(base_bytes)  # RSS before any model: the floor of the baseline
        self.observed_base = self.base  # the baseline as last sampled (`observe`)
        self.rss = self.base  # the process's RSS when last sampled
        self._lock = threading.Lock()
        self._taking = threading.Lock()  # a check against the total and what it commits
        self._models: dict[str, tuple[int, int]] = {}  # name -> (weights, KV reserve)
        self._loading: dict[str, int] = {}  # name -> peak bytes reserved while it loads
        self._live: dict[int, Ticket] = {}
        self._waiting = 0
        self.actions: Counter[str] = Counter()

    # ---- what is committed -------------------------------------------------------------------

    def _ram_bytes(self) -> int:
        return self.tiers.ram_bytes() if self.tiers is not None else 0

    def _fixed(self, excluding: str | None = None, live: bool = True) -> int:
        """Everything but the RAM tier, which can spill: the baseline, each model's weights and
        the larger of its reserve and its live sequences' caches."""
        with self._lock:
            per_model: dict[str, int] = {}
            if live:
                for ticket in self._live.values():
                    per_model[ticket.model] = per_model.get(ticket.model, 0) + ticket.bytes
            total = max(self.base, self.observed_base) + sum(self._loading.values())
            for name, (weights, reserve) in self._models.items():
                if name != excluding:
                    total += weights + max(reserve, per_model.pop(name, 0))
            return total + sum(per_model.values())  # sequences of models gone meanwhile

    def committed(self) -> int:
        return self._fixed() + self._ram_bytes()

    def live_bytes(self) -> int:
        with self._lock:
            return sum(ticket.bytes for ticket in self._live.values())

    def models_bytes(self) -> int:
        """Weights and reserves of the loaded models."""
        with self._lock:
            return sum(weights + reserve for weights, reserve in self._models.values())

    def free_for_load(self) -> int:
        """Room for one more model's load peak and reserve (the RAM tier spills to make room)."""
        return self.total - self._fixed()

    def baseline(self) -> int:
        """The process without models: its RSS before any, or more as last observed."""
        return max(self.base, self.observed_base)

    def alone_room(self) -> int:
        """What one model could have with every other unloaded and nothing running."""
        return self.total - self.baseline()

    def observe(self, rss: int | None = None) -> int:
        """Sample the process's RSS and count what the accounting does not explain as baseline
        (never below the RSS before any model). Called between loads and unloads, when no load
        is in flight (a load's pages are not charged until it ends). Returns the RSS."""
        from rewind.memory import process_rss

        rss = process_rss() if rss is None else int(rss)
        with self._lock:
            if self._loading:
                return rss
            explained = sum(weights for weights, _ in self._models.values())
            explained += sum(ticket.bytes for ticket in self._live.values())
        explained += self._ram_bytes()
        self.rss = rss
        self.observed_base = max(self.base, rss - explained)
        return rss

    # ---- loads -------------------------------------------------------------------------------

    def begin_load(self, name: str, peak_bytes: int) -> None:
        """Hold `peak_bytes` for a load in flight: its RSS rises by up to that before the model
        is charged what it keeps."""
        with self._lock:
            self._loading[name] = int(peak_bytes)
        self.rebalance()

    def end_load(self, name: str) -> None:
        with self._lock:
            self._loading.pop(name, None)

    # ---- models ------------------------------------------------------------------------------

    def set_model(self, name: str, weights: int, reserve: int = 0) -> None:
        with self._lock:
            self._models[name] = (int(weights), int(reserve))
        self.rebalance()

    def drop_model(self, name: str) -> None:
        with self._lock:
            self._models.pop(name, None)
        self.rebalance()

    # ---- sequences ---------------------------------------------------------------------------

    def reserve(self, kv: KvShape, tokens: int, model: str) -> Ticket | None:
        """A ticket for a new sequence of `tokens` if its cache fits now, else None (it waits);
        raises NeverFits for one that cannot fit even alone beside its model."""
        self.check(kv, tokens, model)
        ticket = Ticket(self, kv, tokens, model)
        return ticket if self._try_take(ticket) else None

    def check(self, kv: KvShape, tokens: int, model: str) -> None:
        """Raise NeverFits for a sequence of `tokens` that could not fit even with nothing else
        running beside its model (its model's whole share)."""
        need = kv.bytes_for(tokens)
        with self._lock:
            weights = self._models.get(model, (0, 0))[0]
        never = self.total - self._fixed(excluding=model, live=False) - weights
        if need > never:
            self.actions["refuse_prompt"] += 1
            raise NeverFits(need, never, tokens, model, self.total)

    def _try_take(self, ticket: Ticket) -> bool:
        # Check and take as one (the server's door and the engine thread both take room).
        with self._taking:
            with self._lock:
                self._live[id(ticket)] = ticket
            if self._fixed() > self.total:  # with it counted (its model's reserve first)
                with self._lock:
                    self._live.pop(id(ticket), None)
                return False
        self.rebalance()
        return True

    def _extend(self, ticket: Ticket, extra: int) -> bool:
        with self._taking:
            ticket.bytes += extra
            if self._fixed() > self.total:  # the caller decides what follows (a cut counts there)
                ticket.bytes -= extra
                return False
        self.rebalance()
        return True

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._live.pop(id(ticket), None)
        self.rebalance()

    @property
    def waiting(self) -> int:
        return self._waiting

    @contextlib.contextmanager
    def waiting_for_room(self) -> Iterator[None]:
        """Count a request waiting for room (stats, and the 429 past max_waiting)."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    # ---- the RAM tier ------------------------------------------------------------------------

    def rebalance(self) -> None:
        """The RAM tier gets what the rest leaves (up to its own --cache-ram): shrinking it
        spills its oldest records to disk."""
        if self.tiers is None:
            return
        room = max(0, self.total - self._fixed())
        held = self._ram_bytes()
        if held > room:
            self.actions["ram_spill"] += 1
            log.info("memory budget: the prompt cache's RAM tier spills %s to disk",
                     gib(held - room))
        self.tiers.restore_ram_budget(room)

    def stats(self) -> dict[str, Any]:
        return {"budget_bytes": self.total, "committed_bytes": self.committed(),
                "base_bytes": self.baseline(), "rss_bytes": self.rss,
                "loading_bytes": sum(self._loading.values()), "models_bytes": self.models_bytes(),
                "live_kv_bytes": self.live_bytes(), "ram_tier_bytes": self._ram_bytes(),
                "waiting": self._waiting, "actions": dict(self.actions)}


@dataclass(frozen=True)
class KvAccount:
    """One engine's sequences in a budget: its model's name and per-sequence cache shape."""

    budget: MemoryBudget
    kv: KvShape
    model: str

    def reserve(self, tokens: int) -> Ticket | None:
        return self.budget.reserve(self.kv, tokens, self.model)

    def check(self, tokens: int) -> None:
        """Raise NeverFits for a prompt that could never be admitted."""
        self.budget.check(self.kv, tokens, self.model)
