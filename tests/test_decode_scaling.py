"""rewind bench decode-scaling: the all-decoding window, the bound's arithmetic, and one --quick
run of the in-process parts (engine, mlx-lm) on a tiny model. No speed is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from rewind.bench import decode_scaling
from rewind.bench.decode_scaling_bound import StreamBytes, hbm_bytes_per_s
from rewind.bench.decode_scaling_window import all_decoding_window, stagger_tokens


def test_window_spans_from_the_last_first_token_to_the_first_last_token() -> None:
    stamps = [[1.0, 2.0, 3.0, 4.0], [2.5, 3.5, 4.5, 5.5]]
    window = all_decoding_window(stamps, prompt_tokens=100)
    assert window.seconds == 4.0 - 2.5
    assert window.tokens == 3  # 3.0 and 4.0 of the first stream, 3.5 of the second
    assert window.tok_s == 2.0


def test_bound_reads_weights_once_and_each_rows_state() -> None:
    sizes = StreamBytes(weight_bytes=4_800_000, kv_bytes_per_token=100, fixed_state_bytes=0)
    assert sizes.step_bytes(2, 1000) == 4_800_000 + 2 * 100 * 1000
    assert round(sizes.bound_tok_s(1, 0)) == 1_000_000  # 1 ms a step at 4.8 TB/s


def test_the_bound_takes_the_cards_own_bandwidth() -> None:
    sizes = StreamBytes(weight_bytes=3_350_000, kv_bytes_per_token=0, fixed_state_bytes=0)
    h100 = hbm_bytes_per_s("NVIDIA H100 80GB HBM3")
    assert round(sizes.bound_tok_s(1, 0, h100)) == 1_000_000  # 1 ms a step at 3.35 TB/s
    assert hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert hbm_bytes_per_s("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bytes_per_s(None) == 4.8e12  # no NVIDIA card: the report names none
    assert hbm_bytes_per_s("NVIDIA A100-SXM4-80GB") == 4.8e12  # not listed: the report says so


def test_stagger_covers_one_chunk_per_step() -> None:
    assert stagger_tokens(32, 1024, 256) == 32 * 4 + 8


def test_quick_run_writes_rows(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    decode_scaling.register(parser)
    args = parser.parse_args(["--quick", "--models", "llama-tiny", "--parts", "engine",
                              "mlx-lm", "--json", str(tmp_path / "out.json"),
                              "--work-dir", str(tmp_path / "models")])
    assert decode_scaling.run(args) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    rows = report["models"]["llama-tiny"]["rows"]
    assert set(rows) == {"1", "3"}
    for parts in rows.values():
        assert parts["engine"]["tok_s"] > 0 and parts["mlx-lm"]["tok_s"] > 0
        assert parts["engine"]["finish_reasons"] == {"length": int(next(
            k for k, v in rows.items() if v is parts))}
        assert parts["engine"]["per_step"]["steps"] > 0
        # The three calls of a step, timed through the engine's step listener.
        per_step = parts["engine"]["per_step"]
        assert per_step["run_ms"] > 0 and per_step["postprocess_ms"] > 0
        assert per_step["schedule_ms"] + per_step["run_ms"] + per_step["postprocess_ms"] \
            == pytest.approx(per_step["step_ms"], abs=0.01)
    assert "| 1 |" in (tmp_path / "out.md").read_text()


def test_reports_name_the_nvidia_card_and_driver_or_none(tmp_path: Path, monkeypatch) -> None:
    """nvidia-smi's answer where there is one (a stand-in script here: this machine has no
    NVIDIA GPU), and None where it is absent."""
    from rewind.bench.machine import machine_info, nvidia_gpu

    monkeypatch.setenv("PATH", str(tmp_path))
    assert nvidia_gpu() is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04'\n")
    smi.chmod(0o755)
    assert nvidia_gpu() == {"name": "NVIDIA H100 80GB HBM3", "driver": "580.159.04"}
    info = machine_info()
    assert info["gpu"]["driver"] == "580.159.04"
    assert info["mlx_backend"] in ("cpu", "cuda", "metal")
