"""Sharded serving on loopback: `mlx.launch --backend ring -n 2` runs two ranks of the engine on
this CPU, each with one shard of the model, and rank 0 replays every step's plan to rank 1.
Tensor-parallel (heads and MLP columns split): a tiny llama and a tiny Gemma 3. Pipeline-parallel
(`--pipeline`, mlx-lm's `pipeline()`: each rank a slice of the layers and only those layers'
caches): the tiny Qwen 3.5 hybrid (linear attention + full attention) and a tiny Ministral 3.
Greedy tokens and log-probabilities must equal a single process running the same MLX layers,
alone and batched, uncached and cached; a second turn restores on every rank, at the same point.
A family without mlx-lm's pipeline() is refused with a clear error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rewind.bench.harness import free_port, free_port_run

TESTS = Path(__file__).resolve().parent
DRIVER = TESTS / "sharded_driver.py"
# Two reductions of the same float32 products in another order (each rank sums its half of the
# heads, then the ring adds the halves): log-probabilities agree to ~1e-6 here.
LOGPROB_ATOL = 1e-4


def run_sharded(model: str, out: Path, layout: str = "tensor",
                timeout: float = 600) -> dict[str, Any]:
    """The driver on two ranks; returns rank 0's results and every rank's cache stats."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    # the console script pip writes; an install without scripts (pip --target) runs its function
    launch = [str(launcher)] if launcher.exists() else [
        sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; "
        "sys.argv[0] = 'mlx.launch'; sys.exit(main())"]
    command = [*launch, "--backend", "ring", "-n", "2", "-p", str(free_port_run(2)), "--",
               sys.executable, str(DRIVER), model, str(out)]
    if layout == "pipeline":
        command.append("--pipeline")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(TESTS)])}
    # A session of its own: on a timeout (ranks waiting on each other's collectives) the ranks
    # are stopped with the launcher, not left spinning.
    launched = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        stdout, stderr = launched.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launched.pid, signal.SIGKILL)
        stdout, stderr = launched.communicate()
        pytest.fail(f"mlx.launch ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    # mlx.launch exits 0 whatever its ranks did: results.json missing is the failure.
    assert launched.returncode == 0 and (out / "results.json").exists(), \
        f"mlx.launch failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return {"results": json.loads((out / "results.json").read_text()),
            "ranks": [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]}


def single_process(model: str, scratch: Path) -> dict[str, Any]:
    """The same scenario in one process on the same MLX layers (no C forward), with a cache."""
    from sharded_driver import scenario

    from rewind.cache.prompt_cache import PromptCache
    from rewind.config import CacheConfig, EngineConfig
    from rewind.engine import Engine
    from rewind.models.loader import load_model

    loaded = load_model(model, native_forward="off")
    config = CacheConfig(cache_dir=scratch, disk_bytes=64 << 20)
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint, config)
    engine = Engine(loaded, EngineConfig(parallel=4, cache=config), prompt_cache).start()
    try:
        return scenario(engine, int(loaded.config.get("vocab_size") or 512))
    finally:
        engine.shutdown()
        prompt_cache.close()


def check_equal(sharded: dict[str, Any], reference: dict[str, Any],
                atol: float = LOGPROB_ATOL) -> None:
    results = sharded["results"]
    assert results.keys() == reference.keys()
    for case, expected in reference.items():
        got = results[case]
        assert got["tokens"] == expected["tokens"], case
        if atol == 0:
            assert got["logprobs"] == expected["logprobs"], case
        else:
            assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=atol), case
        assert got["cached"] == expected["cached"], case
    # Uncached and cached give the same answer; the repeat and the second turn were restored.
    assert results["repeat"]["tokens"] == results["alone"]["tokens"]
    assert results["alone"]["cached"] == 0 and results["repeat"]["cached"] > 0
    assert results["second_turn"]["cached"] > results["repeat"]["cached"]
    # Every rank restored, and the same number of tokens: the ranks agreed on each point.
    restored = [rank["tokens_restored"] for rank in sharded["ranks"]]
    assert restored[0] == restored[1] == results["repeat"]["cached"] + results["second_turn"]["cached"]
    assert [rank["rank"] for rank in sharded["ranks"]] == [0, 1]


# One family of each layout runs in CI (~10 s each on 2 cores); the others on demand.
@pytest.mark.parametrize("family", ["llama", pytest.param("gemma3", marks=pytest.mark.on_demand)])
def test_tensor_parallel_equals_single_process(
        family: str, tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    model = str(tiny_model_path(family))
    sharded = run_sharded(model, tmp_path / "sharded")
    check_equal(sharded, single_process(model, tmp_path / "single"))


# Ministral 3's text model (mlx-lm's `ministral3`, which has pipeline()): the tiny llama's
# weights and sizes under Ministral 3's yarn rope and position-scaled attention (as
# rewind.testing.tiny_vlm's ministral3 variant; scaling changes past 64 positions here).
MINISTRAL3 = {
    "model_type": "ministral3", "architectures": ["Ministral3ForCausalLM"],
    "rope_parameters": {"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0,
                        "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
                        "original_max_position_embeddings": 64},
}


@pytest.fixture(scope="session")
def pipeline_model_path(tiny_model_path: Callable[[str], Path],
                        tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    def get(family: str) -> Path:
        if family == "ministral3":
            from rewind.testing.tiny_models import build_tiny_model

            return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-ministral3"),
                                    overrides=MINISTRAL3)
        return tiny_model_path(family)

    return get


@pytest.mark.parametrize("family", ["qwen3_5",
                                    pytest.param("ministral3", marks=pytest.mark.on_demand)])
def test_pipeline_parallel_equals_single_process(
        family: str, pipeline_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """`--pipeline`: rank 1 runs the first half of the layers, rank 0 the second half; the same
    checks as the tensor layout, with log-probabilities exactly equal. Each rank's caches are its own layers' only, and its records
    are keyed and stored under its place in the layout."""
    model = str(pipeline_model_path(family))
    # ~10 s when it works; a hang (the stages' send/recv paired with the wrong call) fails soon.
    sharded = run_sharded(model, tmp_path / "sharded", layout="pipeline", timeout=180)
    # Bit for bit: every layer runs whole, on the same inputs, in the same order; only which
    # process runs it changes (no reduction is split, unlike the tensor layout).
    check_equal(sharded, single_process(model, tmp_path / "single"), atol=0.0)
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    held = [rank["cache_layers"] for rank in sharded["ranks"]]
    assert [len(h) for h in held] == [layers // 2, layers // 2], held
    if family == "qwen3_5":  # linear, full, linear, full: each stage one of each
        assert held[0] == held[1] == ["ArraysCache", "GrowingKVCache"], held
    for r, rank in enumerate(sharded["ranks"]):
        assert rank["fingerprint"].endswith(f"|pipeline-{r}-of-2")
        assert Path(rank["cache_dir"]).name == f"pipeline-{r}-of-2"


def test_pipeline_refused_for_a_family_without_it(tiny_model_path: Callable[[str], Path],
                                                  tmp_path: Path) -> None:
    """mlx-lm's llama has no pipeline(): `mlx.launch -- rewind serve --pipeline` exits with a
    clear error on every rank (before any collective, so nothing hangs)."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "--backend", "ring", "-n", "2", "-p", str(free_port_run(2)), "--",
               sys.executable, "-m", "rewind", "serve", "--model", str(tiny_model_path("llama")),
               "--port", str(free_port()), "--cache-dir", str(tmp_path / "cache"), "--pipeline"]
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": src}, capture_output=True,
                          text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    # mlx.launch itself exits 0 whatever its ranks did; it reports their codes. The first rank
    # to exit has the launcher stop the other, which may not have printed yet.
    assert "exited with code 2" in output, output[-2000:]
    assert "rewind serve: mlx-lm's llama has no pipeline layout" in output, output[-2000:]
    assert "run it tensor-parallel (without --pipeline)" in output
    assert "qwen3_5" in output and "Traceback" not in output, output[-2000:]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.on_demand  # 68 s on 2 cores; the tiny families' tensor-parallel tests run in CI
def test_tensor_parallel_default_model_equals_single_process(tmp_path: Path) -> None:
    sharded = run_sharded("default", tmp_path / "sharded", timeout=1200)
    check_equal(sharded, single_process("default", tmp_path / "single"))


def test_rewind_serve_under_mlx_launch(tiny_model_path: Callable[[str], Path],
                                       tmp_path: Path) -> None:
    """`mlx.launch -- rewind serve`: rank 0 answers HTTP with the single process's greedy answer,
    and the repeated request is restored (on both ranks: they agree before any prefill)."""
    import time

    import httpx
    from live_server import tiny_live_server

    folder = tiny_model_path("llama")
    body = {"messages": [{"role": "user", "content": "Name three colours and a bird."}],
            "max_tokens": 8, "temperature": 0}
    with tiny_live_server(folder, tmp_path / "single") as single:
        expected = httpx.post(f"{single.url}/v1/chat/completions", json=body, timeout=60).json()
    port = free_port()
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "--backend", "ring", "-n", "2", "-p", str(free_port_run(2)), "--",
               sys.executable, "-m", "rewind", "serve", "--model", str(folder), "--port",
               str(port), "--cache-dir", str(tmp_path / "cache")]
    src = str(Path(__file__).resolve().parents[1] / "src")
    server = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": src},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        answers = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
                   for _ in range(2)]
    finally:
        os.killpg(server.pid, 15)
        output = server.communicate(timeout=60)[0].decode(errors="replace")
    assert server.returncode is not None
    for answer in answers:
        assert answer["choices"][0]["message"] == expected["choices"][0]["message"], output[-2000:]
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "rank 1 of 2: loading a tensor-parallel shard" in output
