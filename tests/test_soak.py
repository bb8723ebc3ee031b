"""The soak in CI: 32 streaming clients for 35 seconds against `rewind serve` on a tiny model,
in its own process (its RSS is the server's alone). `rewind bench soak` is the 30-minute run.
(Two minutes, then 90, 60, 45 and 35 s, as CI neared its 20-minute bound: the real CI ran the
whole job in 1,116 s on 2026-12-06, and a fresh clone here took 23 min 46 s at 4e04846.)"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rewind.bench.harness import ServerProcess, free_port, tree_rss_bytes
from rewind.bench.soak import SCENARIOS, soak

SECONDS = 25
# In 90 s no client finishes one agent session (6 turns; 348 requests for 32 clients, measured),
# so prompts grow through the whole run and RSS between two idle moments moved by -3.6% and
# +11.0% in two runs of the same commit. A leak of anything per request (a cache, a sequence's
# buffers) passes 25% within a few hundred requests; the 10% target belongs to `rewind bench
# soak`'s 30 minutes, where every session turns over many times (+1.5%, benchmarks/results/soak.md).
RSS_GROWTH_LIMIT = 0.25


def test_soak_has_no_errors_no_leaks_and_stays_healthy(tiny_model_path, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", str(tiny_model_path("llama")),
            "--port", str(port), "--parallel", "4", "--cache-ram", "8MiB", "--cache-disk", "64MiB",
            "--cache-dir", str(tmp_path), "--log-level", "warning"]
    server = ServerProcess("rewind", argv, port, Path(tmp_path) / "server.log",
                           ready_paths=("/health",))
    with server.start():
        server.wait_ready(120)
        result = asyncio.run(soak(server.base_url, server.model_id, SECONDS, 32,
                                  lambda: tree_rss_bytes(server.pid)))
        log = server.log_tail(40)
    summary = result.summary()
    assert result.errors == [], (result.errors[:5], log)
    # /health is polled every second.
    assert result.health_failures == [] and result.health_checks >= 0.8 * SECONDS
    assert not any(result.idle_after.values()), result.idle_after
    timeline = summary["rss_timeline_mib"]
    # Growth only: less memory at the end is no leak.
    assert result.rss_drift <= RSS_GROWTH_LIMIT, (result.rss_warm, result.rss_end, timeline)
    seen = {outcome.scenario for outcome in result.outcomes}
    assert seen >= set(SCENARIOS) - {"image"}, seen
    # 348 requests in 90 s were measured while it asked for the default model by mistake; the
    # tiny model answers faster (130 was the floor at 35 s, scaled to 25 s).
    assert summary["requests"] >= 90 and summary["ttft_seconds"]["p99"] is not None
