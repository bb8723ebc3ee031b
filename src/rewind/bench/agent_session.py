"""`rewind bench agent-session`: Claude Code's recorded session replayed turn by turn, as an
interactive session sends it, with and without Rewind's normalization of its billing header.

The requests are the ones Claude Code 2.1 sent in the end-to-end tests (tests/data/
agent_traffic.json: its first request, its retry after an answer cut at max_tokens, and the
request carrying a tool's result). Interactive Claude Code puts `cch=XXXXX` in its first system
block, new on every request; each replayed request gets a new one. Row "normalized": the block
as Claude Code sends it, which Rewind drops before templating. Row "not normalized": the same
changing block under a name Rewind does not know, so it stays in the prompt, as on a server
without the normalization. Reported per turn: prompt tokens, cached tokens, time to first token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "data" / "agent_traffic.json"
HEADER = "x-anthropic-billing-header:"
UNKNOWN_HEADER = "x-billing-header-renamed:"


def session_requests() -> list[dict[str, Any]]:
    recorded = json.loads(FIXTURE.read_text())
    first, _, retry = recorded["claude_code"]
    return [first, retry, *recorded["claude_code_tool_result"]]


def with_cch(body: dict[str, Any], cch: str, normalized: bool) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    block = body["system"][0]
    text = block["text"].rstrip().rstrip(";") + f"; cch={cch};"
    block["text"] = text if normalized else text.replace(HEADER, UNKNOWN_HEADER, 1)
    return body


def replay_turn(url: str, model: str, request: dict[str, Any], body: dict[str, Any],
                max_tokens: int) -> dict[str, Any]:
    body = {**body, "model": model, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first_event = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + request["path"], json=body, timeout=900,
                      headers={k: v for k, v in request["headers"].items()
                               if k.lower() not in ("content-length", "host")}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("type") == "message_start":
                usage = event["message"]["usage"]
            if event.get("type") == "content_block_delta" and first_event is None:
                first_event = time.perf_counter()
    ttft = (first_event or time.perf_counter()) - started
    return {"prompt_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"],
            "cached_tokens": usage["cache_read_input_tokens"], "ttft_s": round(ttft, 2)}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def run(args: argparse.Namespace) -> int:
    from rewind.bench.harness import ServerProcess, free_port
    from rewind.bench.machine import command_line
    from rewind.bench.report import Report, Table
    from rewind.bench.servers import openblas_env

    requests = session_requests()
    records = []
    for normalized in (True, False):
        with tempfile.TemporaryDirectory() as scratch:
            port = free_port()
            argv = [sys.executable, "-m", "rewind", "serve", "--model", args.model, "--port",
                    str(port), "--cache-dir", scratch]
            server = ServerProcess("rewind", argv, port, Path(scratch) / "server.log",
                                   env=openblas_env(), ready_paths=("/health",))
            with server.start():
                server.wait_ready()
                for turn, request in enumerate(requests, start=1):
                    body = with_cch(request["body"], f"{turn:05x}", normalized)
                    row = replay_turn(server.base_url, server.model_id or args.model, request,
                                      body, args.max_tokens)
                    records.append({"normalized": normalized, "turn": turn, **row})
                    print(records[-1], flush=True)
    table = Table("Claude Code's session, turn by turn, with a billing header new on every "
                  "request", ["billing header", "turn", "prompt tokens", "cached", "TTFT (s)"],
                  [["dropped (Rewind)" if r["normalized"] else "kept (not recognized)",
                    str(r["turn"]), str(r["prompt_tokens"]), str(r["cached_tokens"]),
                    f"{r['ttft_s']:.1f}"] for r in records])
    report = Report(workload="agent-session", command=command_line(),
                    params={"model": args.model, "max_tokens": args.max_tokens,
                            "fixture": "tests/data/agent_traffic.json"},
                    servers={"rewind": f"rewind serve --model {args.model}"},
                    fairness=["the same recorded requests on the same server build; only the "
                              "header's name differs"],
                    records=records, tables=[table])
    for path in report.write(args.out, "agent-session"):
        print(f"wrote {path}")
    print(table.markdown())
    return 0
