"""`rewind bench model-switch`: how long a request naming a model waits for it.

- load: a request naming an unloaded model -> its first token (streamed, one output token), for
  the default model and a ~1B-shaped random-weight llama, with the weights' pages evicted from
  the page cache (posix_fadvise DONTNEED on each file: no root needed) and then warm;
- switch: both loaded, requests alternating between them (first-token time of each);
- churn: 20 loads over 4 models under a --memory-budget that fits the two largest (as the
  server measured them loaded), the server's RSS sampled every 10 ms (it must stay under the
  budget);
- mlx-lm's server on the same folders: it holds one model and loads the one a request names.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from rewind.bench.machine import command_line, machine_info, machine_markdown, repo_root

ONE_B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
         "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
         "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 8192,
         "rope_theta": 500000.0, "tie_word_embeddings": True}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--churn-loads", type=int, default=20)
    parser.add_argument("--skip-mlx-lm", action="store_true")
    parser.add_argument("--churn-budget", type=int, default=None,
                        help="--memory-budget bytes for the churn (default: the two largest "
                        "models as measured loaded + the baseline + 400 MiB)")


def build_one_b(folder: Path) -> Path:
    """A llama with Llama-3.2-1B's layer shapes (the tiny models' 512-token vocabulary), random
    bf16 weights: ~1.0 B parameters, 1.9 GB."""
    if (folder / "config.json").exists():
        return folder
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from rewind.testing.tiny_models import build_tiny_model

    partial = folder.with_name(folder.name + ".partial")
    tiny = build_tiny_model("llama", partial)
    model = llama.Model(llama.ModelArgs.from_dict(ONE_B))
    model.update(nn.utils.tree_map(lambda a: (a * 0.02).astype(mx.bfloat16)
                                   if isinstance(a, mx.array) else a, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    for file in tiny.glob("*.safetensors"):
        file.unlink()
    mx.save_safetensors(str(tiny / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((tiny / "config.json").read_text())
    config.update(ONE_B)
    config.pop("quantization", None)
    (tiny / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tiny, folder)
    return folder


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (the next read comes from disk)."""
    for file in folder.iterdir():
        if file.is_file():
            with file.open("rb") as handle:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def first_token(url: str, model: str, timeout: float = 600) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{model}: {answer.status_code} {answer.read()[:300]!r}")
        for line in answer.iter_lines():
            if line.startswith("data:") and '"choices"' in line and "delta" in line:
                return time.perf_counter() - started
    raise RuntimeError(f"{model}: no token")


class Server:
    def __init__(self, argv: list[str], url: str, log: Path) -> None:
        self.argv, self.url, self.log = argv, url, log
        self.rss_max = 0
        self._stop = threading.Event()

    def __enter__(self) -> Server:
        self.handle = self.log.open("w")
        self.process = subprocess.Popen(self.argv, stdout=self.handle, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        import psutil

        process = psutil.Process(self.process.pid)
        while not self._stop.is_set():
            try:
                self.rss_max = max(self.rss_max, process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.handle.close()


def rewind_argv(models: list[Path | str], port: int, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "rewind", "serve", "--port", str(port), "--parallel", "1",
            "--log-level", "info"]
    for model in models:
        argv += ["--model", str(model)]
    return argv + list(extra)


def unload(url: str, model: str) -> None:
    answer = httpx.post(f"{url}/v1/models/unload", json={"model": model}, timeout=600)
    answer.raise_for_status()


def run(args: argparse.Namespace) -> int:
    from rewind.models.registry import ensure_default
    from rewind.paths import cache_home
    from rewind.testing.tiny_models import build_tiny_model

    out = args.out or repo_root() / "benchmarks" / "results"
    logs = cache_home() / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    bench_models = cache_home() / "bench-models"
    default = ensure_default()
    one_b = build_one_b(bench_models / "llama-1b-shape-random-bf16")
    tiny = bench_models / "tiny-llama"
    if not (tiny / "config.json").exists():
        build_tiny_model("llama", tiny)
    url = f"http://127.0.0.1:{args.port}"
    results: dict[str, Any] = {"command": command_line(), "machine": machine_info(),
                               "models": {"default": str(default), "1b": str(one_b)}}

    # ---- Rewind: loads (cold, warm) and switches -----------------------------------------
    rewind: dict[str, Any] = {}
    f32 = next(bench_models.glob("default-bf16-*-f32-for-mlx-lm"), None)
    with Server(rewind_argv([tiny, "default", one_b, *([f32] if f32 else [])], args.port), url,
                logs / "model-switch-rewind.log") as server:
        for name, model, folder in (("default", "default", default), ("1b", str(one_b), one_b)):
            evict(folder)
            cold = first_token(url, model)
            unload(url, model)
            warm = first_token(url, model)
            unload(url, model)
            rewind[f"load_{name}_cold_s"], rewind[f"load_{name}_warm_s"] = cold, warm
            print(f"rewind {name}: cold {cold:.2f} s, warm {warm:.2f} s", flush=True)
        first_token(url, "default"), first_token(url, str(one_b))
        switches = [first_token(url, "default" if i % 2 else str(one_b))
                    for i in range(args.switches)]
        rewind["switch_s"] = switches
        print(f"rewind switches: {[round(s, 3) for s in switches]}", flush=True)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        weights = {m["id"]: m.get("memory_bytes", 0) for m in models if m.get("loaded")}
        if f32 is not None:  # what the float32 copy keeps loaded, measured the same way
            unload(url, str(one_b))
            first_token(url, str(f32))
            models = httpx.get(f"{url}/v1/models").json()["data"]
            weights.update({m["id"]: m.get("memory_bytes", 0) for m in models
                            if m["id"] == str(f32)})
        metrics = httpx.get(f"{url}/metrics").text
        base = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith('rewind_memory_bytes{part="base"}'))
    results["rewind"] = rewind

    # ---- Rewind: churn under a budget for two -------------------------------------------
    churn_models = [str(tiny), "default", str(one_b)] + ([str(f32)] if f32 else [])
    sizes = sorted(weights.get(model, 0) for model in churn_models)
    budget = args.churn_budget or int(base + sizes[-1] + sizes[-2] + (400 << 20))
    churn: dict[str, Any] = {"budget_bytes": budget, "models": churn_models}
    with Server(rewind_argv([tiny, *churn_models[1:]], args.port, "--memory-budget",
                            str(budget), "--kv-reserve-tokens", "256"), url,
                logs / "model-switch-churn.log") as server:
        times, refused = [], []
        for index in range(args.churn_loads):
            model = churn_models[(index + 1) % len(churn_models)]
            try:
                times.append(first_token(url, model))
            except RuntimeError as exc:  # the guard refusing a load is an answer, recorded
                refused.append(str(exc)[:300])
                print(f"churn load {index}: {exc}", flush=True)
        churn["refused"] = refused
        metrics = httpx.get(f"{url}/metrics").text
        churn["first_token_s"] = times
        churn["rss_max_bytes"] = server.rss_max
        churn["model_bytes"] = {model: weights.get(model, 0) for model in churn_models}
        churn["unloads_lru"] = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                   if line.startswith("rewind_model_unloads_total")
                                   and 'reason="lru"' in line)
    churn["under_budget"] = churn["rss_max_bytes"] <= budget
    print(f"churn: max RSS {churn['rss_max_bytes'] / 2**30:.2f} GiB, budget "
          f"{budget / 2**30:.2f} GiB, lru unloads {churn['unloads_lru']}", flush=True)
    results["churn"] = churn

    # ---- mlx-lm's server: one model, swapped to the one a request names -----------------
    if not args.skip_mlx_lm:
        mlx: dict[str, Any] = {}
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(tiny), "--port",
                str(args.port), "--log-level", "WARNING"]
        with Server(argv, url, logs / "model-switch-mlx-lm.log") as server:
            for name, folder in (("default", default), ("1b", one_b)):
                evict(folder)
                mlx[f"load_{name}_cold_s"] = first_token(url, str(folder))
                first_token(url, str(tiny))
                mlx[f"load_{name}_warm_s"] = first_token(url, str(folder))
                print(f"mlx-lm {name}: {mlx[f'load_{name}_cold_s']:.2f} / "
                      f"{mlx[f'load_{name}_warm_s']:.2f} s", flush=True)
            mlx["switch_s"] = [first_token(url, str(default) if i % 2 else str(one_b))
                               for i in range(args.switches)]
            mlx["rss_max_bytes"] = server.rss_max
        results["mlx_lm"] = mlx

    out.mkdir(parents=True, exist_ok=True)
    (out / "model-switch.json").write_text(json.dumps(results, indent=2))
    (out / "model-switch.md").write_text(markdown(results))
    print((out / "model-switch.md").read_text())
    return 0


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def markdown(results: dict[str, Any]) -> str:
    rewind, churn, mlx = results["rewind"], results["churn"], results.get("mlx_lm")

    def row(label: str, key: str) -> str:
        other = f"{mlx[key]:.2f} s" if mlx and key in mlx else "not run"
        return f"| {label} | {rewind[key]:.2f} s | {other} |"

    switch_mlx = f"{_median(mlx['switch_s']):.2f} s (a reload)" if mlx else "not run"
    lines = [
        "# Model switching", "", f"Command: `{results['command']}`", "",
        "Time from a request naming a model to its first streamed token (one output token, a "
        "one-line prompt). Cold: each weight file's pages were evicted from the page cache "
        "first (posix_fadvise DONTNEED; dropping every cache needs root). The 1B model has "
        "Llama 3.2 1B's layer shapes and random bf16 weights (1.9 GB).", "",
        "| | Rewind | mlx-lm server |", "| --- | --- | --- |",
        row("default (Gemma 3 270M bf16), cold", "load_default_cold_s"),
        row("default, warm page cache", "load_default_warm_s"),
        row("1B-shaped llama, cold", "load_1b_cold_s"),
        row("1B-shaped llama, warm", "load_1b_warm_s"),
        f"| switch between the two, both loaded (median of {len(rewind['switch_s'])}) | "
        f"{_median(rewind['switch_s']):.3f} s | {switch_mlx} |", "",
        f"Churn: {len(churn['first_token_s'])} loads over {len(churn['models'])} models under "
        f"--memory-budget {churn['budget_bytes'] / 2**30:.2f} GiB (fits the two largest): "
        f"max RSS {churn['rss_max_bytes'] / 2**30:.2f} GiB "
        f"({'under' if churn['under_budget'] else 'OVER'} the budget), "
        f"{churn['unloads_lru']:.0f} least-recently-used unloads, "
        f"{len(churn.get('refused', []))} loads refused, first token median "
        f"{_median(churn['first_token_s']):.2f} s.", "",
        "## Machine", "", machine_markdown(results["machine"]), ""]
    return "\n".join(lines)
