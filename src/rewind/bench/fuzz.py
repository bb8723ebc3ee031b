"""`rewind bench fuzz`: schemathesis against every route of a live `rewind serve`, from the
OpenAPI description the server publishes, for a bounded time.

What counts: responses of 5xx (schemathesis's not_a_server_error), errors not in the called API's
own shape and bodies that are not strict JSON (rewind.bench.fuzz_checks), the server process
still alive, and a greedy answer after the run equal to the same request's answer before it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

CHECKS = "not_a_server_error,error_in_api_shape,strict_json_bodies"
# Schemathesis's error titles that mean the server did not answer; its other errors are the
# fuzzer's own (a generator that hypothesis finds flaky, a schema construct it cannot draw).
SERVER_ERROR_TITLES = frozenset({"Network Error", "Unresponsive Operation", "Unhealthy API",
                                 "Server Unavailable"})
PROBE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@dataclass
class FuzzOutcome:
    cases: int
    failures: list[dict[str, Any]]
    errors: list[Any]
    exit_code: int
    seconds: float
    statuses: dict[str, int] = field(default_factory=dict)  # error answers the server counted
    report: dict[str, Any] = field(default_factory=dict)
    output: str = ""  # schemathesis's own account (its report JSON names errors only by title)

    @property
    def server_errors(self) -> list[Any]:
        return [error for error in self.errors if error.get("title") in SERVER_ERROR_TITLES]

    @property
    def fuzzer_errors(self) -> list[Any]:
        return [error for error in self.errors if error.get("title") not in SERVER_ERROR_TITLES]

    @property
    def clean(self) -> bool:
        return not self.failures and not self.server_errors


def schemathesis_command() -> str:
    beside = Path(sys.executable).with_name("schemathesis")
    found = str(beside) if beside.exists() else shutil.which("schemathesis")
    if found is None:
        raise RuntimeError("schemathesis is not installed: pip install 'rewind-engine[dev]'")
    return found


def error_statuses(url: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("rewind_http_errors_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def fuzz(url: str, seconds: float, seed: int = 0, workers: int = 2,
         examples: int = 25) -> FuzzOutcome:
    """Run schemathesis for `seconds` (its phases repeat until the time is spent)."""
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        argv = [schemathesis_command(), "run", f"{url}/openapi.json", "--checks", CHECKS,
                "--max-examples", str(examples), "--max-time", str(int(seconds)),
                "--workers", str(workers), "--seed", str(seed), "--report", "json",
                # Its default of 10 s reads a slow answer (a long fuzzed prompt on a CPU) as
                # no answer at all.
                "--request-timeout", "600",
                "--report-json-path", str(report_path), "--no-color",
                "--suppress-health-check", "all"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "rewind.bench.fuzz_checks"}
        started = time.monotonic()
        finished = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=seconds + 300)
        elapsed = time.monotonic() - started
        if not report_path.exists():
            raise RuntimeError(f"schemathesis wrote no report (exit {finished.returncode}):\n"
                               f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}")
        report = json.loads(report_path.read_text())
    return FuzzOutcome(cases=report["test_cases"]["generated"], failures=report["failures"],
                       errors=report["errors"], exit_code=report["exit_code"], seconds=elapsed,
                       statuses=error_statuses(url), report=report, output=finished.stdout)


def _problems(output: str, limit: int = 6000) -> str:
    """The part of schemathesis's console report that names what went wrong."""
    start = min((i for i in (output.find("ERRORS"), output.find("FAILURES")) if i >= 0),
                default=max(0, len(output) - limit))
    return output[start:start + limit]


def probe(url: str, model: str | None = None) -> dict[str, Any]:
    """A greedy completion: text and token counts, to compare before and after."""
    body = {**PROBE, **({"model": model} if model else {})}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    answer.raise_for_status()
    data = answer.json()
    return {"text": data["choices"][0]["text"],
            "completion_tokens": data["usage"]["completion_tokens"]}


# ---------------------------------------------------------------- the bench command


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model to serve (default: default)")
    parser.add_argument("--seconds", type=float, default=600,
                        help="fuzzing time (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="concurrent fuzzing clients")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="the server's output cap, so each case stays short")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def run(args: argparse.Namespace) -> int:
    from rewind.bench.harness import ServerProcess, free_port
    from rewind.bench.machine import command_line
    from rewind.bench.report import Report, Table
    from rewind.bench.servers import openblas_env

    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        argv = [sys.executable, "-m", "rewind", "serve", "--model", args.model, "--port",
                str(port), "--max-tokens", str(args.max_tokens), "--cache-dir", scratch]
        server = ServerProcess("rewind", argv, port, Path(scratch) / "server.log",
                               env=openblas_env(), ready_paths=("/health",))
        with server.start():
            server.wait_ready()
            before = probe(server.base_url)
            print(f"fuzzing {server.base_url} for {args.seconds:.0f} s ...", flush=True)
            outcome = fuzz(server.base_url, args.seconds, args.seed, args.workers)
            alive = server.process is not None and server.process.poll() is None
            after = probe(server.base_url) if alive else None
            log_tail = server.log_tail(40)
    same = after == before
    table = Table("Fuzzing every route", ["what", "outcome"], [
        ["cases generated", str(outcome.cases)],
        ["failing cases (5xx, error not in the API's shape, non-strict JSON)",
         str(len(outcome.failures))],
        ["requests that got no answer", str(len(outcome.server_errors))],
        ["fuzzer's own errors (not the server's)",
         ", ".join(f"{e.get('title')} x{e.get('count')}" for e in outcome.fuzzer_errors)
         or "none"],
        ["error answers by status", ", ".join(f"{k}: {v}" for k, v in
                                              sorted(outcome.statuses.items())) or "none"],
        ["server process alive afterwards", "yes" if alive else "NO"],
        ["greedy answer after == before", "yes" if same else "NO"],
    ])
    report = Report(workload="fuzz", command=command_line(),
                    params={"model": args.model, "seconds": args.seconds, "seed": args.seed,
                            "workers": args.workers, "max_tokens": args.max_tokens,
                            "checks": CHECKS},
                    servers={"rewind": f"rewind serve --model {args.model} --max-tokens "
                                       f"{args.max_tokens}"},
                    fairness=["one server, no baseline: this is a robustness run"],
                    summary={"cases": outcome.cases, "failures": len(outcome.failures),
                             "server_errors": len(outcome.server_errors),
                             "fuzzer_errors": outcome.fuzzer_errors, "statuses": outcome.statuses,
                             "alive": alive, "same_answer": same,
                             "schemathesis_seconds": round(outcome.seconds, 1)},
                    records=[{"failures": outcome.failures[:50], "errors": outcome.errors[:50],
                              "valid_rates": outcome.report.get("valid_rates"),
                              "before": before, "after": after}],
                    tables=[table])
    if not alive or outcome.failures or outcome.server_errors:
        report.notes.append(f"server log tail: {log_tail}")
        report.notes.append("schemathesis's report, its errors and failures: "
                            + _problems(outcome.output))
    for path in report.write(args.out, "fuzz"):
        print(f"wrote {path}")
    print(table.markdown())
    return 0 if outcome.clean and alive and same else 1
