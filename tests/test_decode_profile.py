"""The decode_profile probe (benchmarks/probes/, outside the package) on a tiny model: every piece
of a pipelined decode step (the path a GPU takes) is timed, the pieces add up to the step, and the
engine is left as it was."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "decode_profile.py"


def _load_probe() -> ModuleType:
    # A script, not a module of the package: loaded from its path, and registered under its name
    # because dataclasses look their module up in sys.modules.
    spec = importlib.util.spec_from_file_location("decode_profile", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


decode_profile = _load_probe()


def test_pipelined_steps_are_broken_down(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert decode_profile.main(["--model", "llama-tiny", "--streams", "1", "2",
                                "--prompt-tokens", "40", "--steps", "8", "--cprofile-steps", "4",
                                "--trace-steps", "3", "--pipeline-decode", "on",
                                "--work-dir", str(tmp_path / "models"),
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pipelined"] is True
    for rows in ("1", "2"):
        timers = report["rows"][rows]["timers"]
        assert timers["steps"] >= 8
        calls = timers["calls_per_step"]
        # One dispatch and one wait for the tokens a step; one emitted token per row.
        assert calls["dispatch_async_eval"] == 1.0 and calls["sync_wait"] == 1.0
        assert calls["_on_token"] == float(rows)
        pieces = timers["pieces_ms"]
        assert abs(sum(pieces.values()) - timers["step_ms"]) < 0.01
        assert report["rows"][rows]["cprofile"]["by_tottime"]
        assert report["rows"][rows]["bare"]["tok_s"] > 0
        assert report["rows"][rows]["mlx_loop"]["step_ms"] > 0
    assert "| 2 |" in out.with_suffix(".md").read_text()


def test_the_engine_is_left_unwrapped() -> None:
    from rewind.engine import sampler, scheduler, stops

    assert scheduler.mx.__name__ == "mlx.core" and sampler.mx.__name__ == "mlx.core"
    assert stops.TextStream.add.__qualname__ == "TextStream.add"
