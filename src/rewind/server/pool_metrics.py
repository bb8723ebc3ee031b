"""/metrics for the model pool and the memory budget: each model's state and bytes, loads,
unloads by reason, and the guard's actions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rewind.server.memory_budget import GUARD_ACTIONS

STATES = ("unloaded", "loading", "loaded", "unloading")


class PoolGauges(Collector):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        pool = self.pool
        state = GaugeMetricFamily("rewind_model_state", "1 for each model's current state",
                                  labels=["model", "state"])
        size = GaugeMetricFamily("rewind_model_memory_bytes",
                                 "Bytes a loaded model's weights and tokenizer hold",
                                 labels=["model"])
        leases = GaugeMetricFamily("rewind_model_requests",
                                   "Requests using each model now", labels=["model"])
        loads = CounterMetricFamily("rewind_model_loads", "Loads of each model",
                                    labels=["model"])
        unloads = CounterMetricFamily("rewind_model_unloads",
                                      "Unloads of each model, by reason (idle, keep_alive, "
                                      "lru, request, engine_failed)", labels=["model", "reason"])
        restarts = CounterMetricFamily("rewind_engine_restarts",
                                       "Engines restarted with their model after a failure",
                                       labels=["model"])
        for slot in pool.slots():
            for name in STATES:
                state.add_metric([slot.name, name], float(slot.state == name))
            size.add_metric([slot.name], float(slot.loaded_bytes
                                               if slot.state in ("loaded", "unloading") else 0))
            leases.add_metric([slot.name], float(slot.leases))
            loads.add_metric([slot.name], float(slot.loads))
            for reason in ("idle", "keep_alive", "lru", "request", "engine_failed"):
                unloads.add_metric([slot.name, reason], float(slot.unloads.get(reason, 0)))
            restarts.add_metric([slot.name], float(slot.restarts))
        yield from (state, size, leases, loads, unloads, restarts)
        yield GaugeMetricFamily("rewind_models_loaded", "Models loaded now",
                                value=float(len(pool.loaded())))
        budget = pool.budget.stats()
        parts = GaugeMetricFamily("rewind_memory_bytes",
                                  "What the memory budget counts, by part", labels=["part"])
        for part in ("base", "models", "loading", "live_kv", "ram_tier", "committed"):
            parts.add_metric([part], float(budget[f"{part}_bytes"]))
        yield parts
        from rewind.memory import process_rss

        # What the OS sees now, beside what the budget counts: the two should stay close.
        yield GaugeMetricFamily("rewind_process_rss_bytes", "The server process's resident "
                                "set size", value=float(process_rss()))
        yield GaugeMetricFamily("rewind_memory_budget_bytes", "--memory-budget",
                                value=float(budget["budget_bytes"]))
        yield GaugeMetricFamily("rewind_memory_waiting_requests",
                                "Requests waiting for room in the memory budget",
                                value=float(budget["waiting"]))
        actions = CounterMetricFamily("rewind_memory_guard_actions",
                                      "What the memory guard did, by action",
                                      labels=["action"])
        for action in GUARD_ACTIONS:
            actions.add_metric([action], float(budget["actions"].get(action, 0)))
        yield actions
