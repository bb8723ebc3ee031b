"""Prometheus metrics: latency histograms fed by the engine's sample listener, token counters fed
at each request's end, and gauges read from the engine and the prompt cache at scrape time.

Each app gets its own CollectorRegistry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rewind.engine import Usage

# The disk tier's fault counters (rewind.cache.store.ScratchStore.stats).
DISK_FAULT_KINDS = ("write_errors", "read_errors", "corrupt", "disk_full", "no_space",
                    "snapshot_errors")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)


class _LiveGauges(Collector):
    """Gauges computed on each scrape from engine.stats() and prompt_cache.stats()."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]],
                 cache_stats: Callable[[], dict[str, Any]] | None) -> None:
        self._engine_stats = engine_stats
        self._cache_stats = cache_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._engine_stats()
        gauges = {
            "rewind_queue_depth": ("Requests waiting for a slot", stats.get("queued", 0)),
            "rewind_running_sequences": ("Sequences holding a slot (prefilling or decoding)",
                                         stats.get("running", 0)),
            "rewind_parallel_slots": ("Configured --parallel", stats.get("parallel", 0)),
            "rewind_mlx_active_memory_bytes": ("MLX active memory",
                                               stats.get("mlx_active_bytes", 0)),
            "rewind_mlx_peak_memory_bytes": ("MLX peak memory", stats.get("mlx_peak_bytes", 0)),
            "rewind_mlx_cache_memory_bytes": ("MLX buffer-cache memory",
                                              stats.get("mlx_cache_bytes", 0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        if self._cache_stats is None:
            return
        cache = self._cache_stats()
        tier_bytes = GaugeMetricFamily("rewind_prompt_cache_bytes",
                                       "Bytes held by the prompt cache, by tier", labels=["tier"])
        for tier in ("ram", "disk"):
            value = _first_number(cache, f"{tier}_bytes", f"{tier}_used_bytes")
            if value is not None:
                tier_bytes.add_metric([tier], float(value))
        yield tier_bytes
        disk = cache.get("disk") if isinstance(cache.get("disk"), dict) else {}
        yield GaugeMetricFamily("rewind_prompt_cache_disk_enabled",
                                "1 while the prompt cache's disk tier takes records",
                                value=float(bool(disk.get("enabled"))))
        for name, key, doc in (
                ("rewind_prompt_cache_loaded_records", "loaded_records",
                 "Records a persistent cache (--cache-persist) reopened at start"),
                ("rewind_prompt_cache_loaded_bytes", "loaded_bytes",
                 "Bytes of the records a persistent cache reopened at start")):
            yield GaugeMetricFamily(name, doc, value=float(disk.get(key, 0)))
        yield GaugeMetricFamily("rewind_prompt_cache_disk_queued_bytes",
                                "Record bytes held in RAM until the disk writer takes them",
                                value=float(disk.get("queued_bytes", 0)))
        yield GaugeMetricFamily("rewind_prompt_cache_unindexed_changes",
                                "Records written (or dropped) since a persistent cache last "
                                "wrote its index: what a kill -9 now would lose",
                                value=float(disk.get("unindexed_changes", 0)))
        faults = CounterMetricFamily("rewind_prompt_cache_disk_faults",
                                     "Disk-tier faults by kind; each cost a recompute, never an "
                                     "answer", labels=["kind"])
        for kind in DISK_FAULT_KINDS:
            faults.add_metric([kind], float(disk.get(kind, 0)))
        yield faults


def _first_number(stats: dict[str, Any], *keys: str) -> float | None:
    """The prompt cache's stats() may nest tiers ({'disk': {'bytes': ..}}) or flatten them."""
    for key in keys:
        if isinstance(stats.get(key), (int, float)):
            return float(stats[key])
    tier = keys[0].split("_")[0]
    nested = stats.get(tier)
    if isinstance(nested, dict):
        for key in ("bytes", "used_bytes"):
            if isinstance(nested.get(key), (int, float)):
                return float(nested[key])
    return None


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]],
                 cache_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("rewind_time_to_first_token_seconds",
                              "Request submitted -> first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("rewind_inter_token_latency_seconds", "Time between two tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("rewind_queue_seconds", "Request submitted -> admitted",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.restore_time = Histogram("rewind_prompt_cache_restore_seconds",
                                      "Time to restore a cached prefix",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("rewind_prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generated_tokens = Counter("rewind_generated_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("rewind_cached_prompt_tokens",
                                     "Prompt tokens restored from the prompt cache, by tier",
                                     ["tier"], registry=r)
        self.drafted_tokens = Counter("rewind_speculative_drafted_tokens",
                                      "Tokens drafted and verified (speculative decoding)",
                                      registry=r)
        self.accepted_tokens = Counter("rewind_speculative_accepted_tokens",
                                       "Drafted tokens the model agreed with", registry=r)
        self.acceptance = Histogram("rewind_speculative_acceptance_ratio",
                                    "Accepted over drafted tokens, per request that drafted",
                                    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                    registry=r)
        self.requests = Counter("rewind_requests", "Finished requests by API and outcome",
                                ["api", "outcome"], registry=r)
        self.http_errors = Counter("rewind_http_errors", "Error answers by status code",
                                   ["status"], registry=r)
        r.register(_LiveGauges(engine_stats, cache_stats))
        self._samples = {"ttft_seconds": self.ttft, "itl_seconds": self.itl,
                         "queue_seconds": self.queue_time, "restore_seconds": self.restore_time}

    def on_engine_sample(self, name: str, seconds: float) -> None:
        """The engine's sample listener (runs on the engine thread; histograms are thread-safe)."""
        histogram = self._samples.get(name)
        if histogram is not None:
            histogram.observe(seconds)

    def on_finish(self, api: str, outcome: str, usage: Usage) -> None:
        self.requests.labels(api, outcome).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        self.cached_tokens.labels("ram").inc(usage.cached_ram_tokens)
        self.cached_tokens.labels("disk").inc(usage.cached_disk_tokens)
        if usage.drafted_tokens:
            self.drafted_tokens.inc(usage.drafted_tokens)
            self.accepted_tokens.inc(usage.accepted_tokens)
            self.acceptance.observe(usage.accepted_tokens / usage.drafted_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
