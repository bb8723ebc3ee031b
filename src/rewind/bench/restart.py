"""`rewind bench restart`: an agent session survives a server restart only with --cache-persist.

One agent session of T turns (a ~2k-token system prompt, each turn adding an answer and a tool
result) against `rewind serve`; then the server is stopped (SIGTERM, as a user's Ctrl-C or a
service manager does) and started again on the same cache folder, and the session's next turn
is sent. Rows: with and without --cache-persist. Reported: the restarted server's start-up time
to /health, and turn T+1's time to first token and cached prompt tokens, next to the same turn
on a server that never stopped (a third run of the same session).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from rewind.bench.textgen import AgenticText, agent_messages


def session(turns: int, system_tokens: int, seed: int = 0) -> tuple[str, str, list[Any]]:
    text = AgenticText(seed)
    return (text.system_prompt(system_tokens), text.user_task(),
            [text.turn() for _ in range(turns + 1)])


def run_row(model: str, persist: bool, turns: int, folder: Path,
            system_tokens: int = 2000) -> dict[str, Any]:
    from rewind.bench.client import make_client, timed_chat
    from rewind.bench.harness import ServerProcess, free_port
    from rewind.bench.servers import openblas_env

    system, task, steps = session(turns, system_tokens)

    def start(tag: str) -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "rewind", "serve", "--model", model, "--port", str(port),
                "--cache-dir", str(folder / "cache")] + (["--cache-persist"] if persist else [])
        server = ServerProcess(f"rewind-{tag}", argv, port, folder / f"{tag}.log",
                               env=openblas_env(), ready_paths=("/health",)).start()
        server.wait_ready()
        return server

    def turn(server: ServerProcess, index: int) -> Any:
        client = make_client(server.base_url)
        messages = agent_messages(system, task, steps[:index])
        return timed_chat(client, messages, max_tokens=8, model=server.model_id or "default")

    first = start("first")
    try:
        for index in range(turns):
            turn(first, index)
    finally:
        first.stop()
    again = start("restarted")
    try:
        restarted = turn(again, turns)  # turn T+1, new to both servers
        startup = again.ready_seconds
    finally:
        again.stop()
    return {"persist": persist, "turns_before": turns,
            "prompt_tokens": restarted.prompt_tokens,
            "restart_startup_s": round(startup, 2),
            "restarted_ttft_s": round(restarted.ttft_s, 3),
            "restarted_cached_tokens": restarted.cached_tokens,
            "answer": restarted.text}


def unstopped_row(model: str, turns: int, folder: Path, system_tokens: int) -> dict[str, Any]:
    """The same session on a server that never stops: turn T+1's figures to compare with."""
    from rewind.bench.client import make_client, timed_chat
    from rewind.bench.harness import ServerProcess, free_port
    from rewind.bench.servers import openblas_env

    system, task, steps = session(turns, system_tokens)
    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", model, "--port", str(port),
            "--cache-dir", str(folder / "cache")]
    with ServerProcess("rewind", argv, port, folder / "unstopped.log", env=openblas_env(),
                       ready_paths=("/health",)).start() as server:
        server.wait_ready()
        client = make_client(server.base_url)
        for index in range(turns + 1):
            timing = timed_chat(client, agent_messages(system, task, steps[:index]),
                                max_tokens=8, model=server.model_id or "default")
    return {"ttft_s": round(timing.ttft_s, 3), "cached_tokens": timing.cached_tokens,
            "answer": timing.text}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=8,
                        help="turns before the restart (the session grows ~600 tokens a turn)")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def run(args: argparse.Namespace) -> int:
    from rewind.bench.machine import command_line
    from rewind.bench.report import Report, Table

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        unstopped = unstopped_row(args.model, args.turns, Path(scratch), args.system_tokens)
    for persist in (True, False):
        with tempfile.TemporaryDirectory() as scratch:
            row = run_row(args.model, persist, args.turns, Path(scratch), args.system_tokens)
            row["same_answer"] = row.pop("answer") == unstopped["answer"]
            rows.append(row)
            print(rows[-1], flush=True)
    table = Table(f"Turn {args.turns + 1} of a session, on a server restarted after turn "
                  f"{args.turns}; never stopped: TTFT {unstopped['ttft_s']:.2f} s with "
                  f"{unstopped['cached_tokens']} tokens cached", [
                      "server", "prompt tokens", "start-up (s)", "TTFT (s)", "cached tokens",
                      "same answer as never stopped"],
                  [[("--cache-persist" if r["persist"] else "default (scratch file)"),
                    str(r["prompt_tokens"]), f"{r['restart_startup_s']:.1f}",
                    f"{r['restarted_ttft_s']:.2f}", str(r["restarted_cached_tokens"]),
                    "yes" if r["same_answer"] else "NO"] for r in rows])
    report = Report(workload="restart", command=command_line(),
                    params={"model": args.model, "turns": args.turns,
                            "system_tokens": args.system_tokens},
                    servers={"rewind": f"rewind serve --model {args.model} [--cache-persist]"},
                    fairness=["both rows: the same session, the same server, stopped with "
                              "SIGTERM and started again on the same --cache-dir"],
                    summary={"rows": rows, "never_stopped": {
                        k: v for k, v in unstopped.items() if k != "answer"}},
                    records=rows, tables=[table])
    for path in report.write(args.out, "restart"):
        print(f"wrote {path}")
    print(table.markdown())
    return 0 if all(r["same_answer"] for r in rows) else 1
