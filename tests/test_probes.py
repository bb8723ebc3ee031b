"""The developer probes in benchmarks/probes/ (kernel and cache microbenchmarks, outside the
installed package) still start, and `rewind bench` lists every workload it can run. Nothing is
timed here: the probes' numbers live in benchmarks/results/."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PROBES = REPO_ROOT / "benchmarks" / "probes"
SRC = str(REPO_ROOT / "src")


def _env() -> dict[str, str]:
    # The probes import rewind; a checkout that is not installed finds it under src/.
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": SRC + (os.pathsep + path if path else "")}


@pytest.mark.parametrize("probe", ["cpu_attention", "gated_delta", "kv_append", "form_speed",
                                   "verify_cost", "decode_kernels", "decode_profile",
                                   "prefill_split", "new_shapes", "turn_latency",
                                   "cached_turn_profile", "sdpa_mask_cost", "matmul_fold",
                                   "mlx_step_host_cost", "compiled_step", "row_alone",
                                   "gpu_speculation", "native_step_time", "stream_cost",
                                   "product_rows", "attention_chain", "skinny_products",
                                   "skinny_tilings"])
def test_probe_starts(probe: str) -> None:
    done = subprocess.run([sys.executable, str(PROBES / f"{probe}.py"), "--help"], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"usage: python benchmarks/probes/{probe}.py" in done.stdout


def test_every_bench_workload_is_in_the_package() -> None:
    from rewind.commands.bench import WORKLOADS

    for name, (module, _) in WORKLOADS.items():
        assert importlib.util.find_spec(module) is not None, name


def test_bench_help_lists_the_workloads_and_points_at_the_probes() -> None:
    done = subprocess.run([sys.executable, "-m", "rewind", "bench", "--help"], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("speed", "agentic", "edits", "prompt-cache", "multi-round-qa", "parallel-chat",
                 "perplexity", "soak"):
        assert f"  {name} " in done.stdout
    assert "benchmarks/probes/" in done.stdout


def test_the_compiled_step_gives_mlx_lms_tokens() -> None:
    """The fixed-shape decode step the GPU measurements time (benchmarks/probes/compiled_step.py),
    plain and compiled, decodes rows of mixed lengths to mlx-lm's greedy tokens (float32, tiny
    Llama; --check fails otherwise)."""
    done = subprocess.run([sys.executable, str(PROBES / "compiled_step.py"), "--check",
                           "--batches", "1", "3", "--prompt-tokens", "40", "--steps", "12"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("same tokens") == 6, done.stdout
