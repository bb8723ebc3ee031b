"""A bounded schemathesis run (about 30 seconds) against a live server on a tiny model, from the
server's own OpenAPI description: no 5xx, every error in the called API's shape, strict JSON,
and the same greedy answer afterwards. `rewind bench fuzz` is the long run."""

from __future__ import annotations

from live_server import tiny_live_server

from rewind.bench.fuzz import fuzz, probe


def test_fuzzing_every_route_finds_no_server_error(tiny_model_path, tmp_path):
    with tiny_live_server(tiny_model_path("llama"), tmp_path, max_tokens=8) as live:
        before = probe(live.url)
        outcome = fuzz(live.url, seconds=20, seed=1234, workers=2)  # 45 until CI neared 20 min
        assert outcome.cases >= 130, outcome.report.get("test_cases")
        assert outcome.clean, (outcome.failures[:3], outcome.server_errors[:3])
        assert "500" not in outcome.statuses
        assert probe(live.url) == before
