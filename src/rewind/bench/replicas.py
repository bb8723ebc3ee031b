"""replicas: S agent sessions through SGLang's router over N `rewind serve` replicas, once per
routing policy.

For each policy the bench starts N fresh replicas (cold prompt caches) and the router in front of
them, warms each replica up directly, then runs the agentic workload's sessions concurrently
through the router: a shared system prompt with tools, each turn adding the answer (reasoning
dropped) and a tool result. Every request carries the session in X-SMG-Routing-Key, which only
the `manual` policy reads. Per turn: time to first token, prompt and cached tokens (usage); per
replica: requests, prompt and cached tokens from its /metrics.

On one machine the replicas share its cores, so this measures where each policy sends the work
and how much of it the prompt caches save, not the throughput of more machines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from rewind.bench.agentic import SYSTEM_SEED, session_script
from rewind.bench.client import timed_chat
from rewind.bench.harness import ServerProcess, free_port
from rewind.bench.report import Report, Table
from rewind.bench.router import POLICIES, ROUTING_KEY_HEADER, start_router
from rewind.bench.servers import ServerOptions, build_server
from rewind.bench.sidebyside import (DEFAULT_OUT, command_line, model_files, out_stem,
                                     server_log_dir)
from rewind.bench.textgen import AgenticText, agent_messages

NAME = "replicas"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="cache_aware,manual,round_robin",
                        help=f"router policies, comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=4, help="concurrent agent sessions")
    parser.add_argument("--turns", type=int, default=6, help="turns per session")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--tool-tokens", type=int, default=450)
    parser.add_argument("--answer-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32, help="generated per turn")
    parser.add_argument("--parallel", type=int, default=4, help="each replica's --parallel")
    parser.add_argument("--model", default=None,
                        help="registry name or MLX folder (default: 'default'; with --quick a "
                             "tiny random gemma3 model)")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a few turns")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--tag", default="")
    parser.add_argument("--ready-timeout", type=float, default=600.0)


def apply_quick(args: argparse.Namespace) -> None:
    args.turns, args.system_tokens, args.tool_tokens, args.answer_tokens = 3, 80, 20, 10
    args.max_tokens = 8


def start_replicas(args: argparse.Namespace, model: Any) -> list[ServerProcess]:
    options = ServerOptions(parallel=args.parallel)
    replicas = [build_server("rewind", model, options, free_port(), server_log_dir())
                for _ in range(args.replicas)]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(timeout=args.ready_timeout)
            # One-off costs (kernel builds, lazy loads) are paid here, not by the first turn.
            timed_chat(client_for(replica.base_url, None), [{"role": "user", "content": "Hi."}],
                       max_tokens=2, model=replica.model_id or "default")
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


def client_for(base_url: str, session: int | None) -> OpenAI:
    headers = {ROUTING_KEY_HEADER: f"session-{session}"} if session is not None else None
    return OpenAI(base_url=f"{base_url}/v1", api_key="bench", timeout=900.0, max_retries=0,
                  default_headers=headers)


def replica_counters(replica: ServerProcess) -> dict[str, float]:
    """Requests, prompt tokens and cached prompt tokens this replica served (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(replica.base_url + "/metrics", timeout=10).text
    totals = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
    names = {"rewind_time_to_first_token_seconds_count": "requests",
             "rewind_prompt_tokens_total": "prompt_tokens",
             "rewind_cached_prompt_tokens_total": "cached_tokens"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
    return totals


def run_policy(args: argparse.Namespace, policy: str, model: Any, system: str,
               scripts: list) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    replicas = start_replicas(args, model)
    # The warm-up requests count in /metrics: subtract them.
    before = [replica_counters(r) for r in replicas]
    model_id = replicas[0].model_id or "default"
    router = start_router([r.base_url for r in replicas], policy, server_log_dir(), model_id)
    try:
        started = time.monotonic()

        def one_session(session: int) -> list[dict[str, Any]]:
            client = client_for(router.base_url, session)
            task, turns = scripts[session]
            rows = []
            for turn in range(args.turns):
                timing = timed_chat(client, agent_messages(system, task, turns[:turn]),
                                    max_tokens=args.max_tokens, model=model_id)
                rows.append({"policy": policy, "session": session, "turn": turn,
                             "ttft_s": timing.ttft_s, "e2e_s": timing.e2e_s,
                             "prompt_tokens": timing.prompt_tokens,
                             "cached_tokens": timing.cached_tokens})
            return rows

        with ThreadPoolExecutor(max_workers=args.sessions) as pool:
            records = [row for rows in pool.map(one_session, range(args.sessions))
                       for row in rows]
        wall = time.monotonic() - started
        after = [replica_counters(r) for r in replicas]
        info = {"wall_s": wall, "router_command": router.command,
                "replica_command": replicas[0].command,
                "replicas": [{key: a[key] - b[key] for key in a} for a, b in zip(after, before)]}
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
    return records, info


def policy_summary(records: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    later = [r for r in records if r["turn"] > 0]

    def share(rows: list[dict[str, Any]]) -> float:
        prompt = sum(r["prompt_tokens"] or 0 for r in rows)
        return sum(r["cached_tokens"] or 0 for r in rows) / prompt if prompt else 0.0

    return {"cached_share": share(records), "cached_share_later_turns": share(later),
            "mean_ttft_s": statistics.mean(r["ttft_s"] for r in records),
            "mean_ttft_later_turns_s": statistics.mean(r["ttft_s"] for r in later) if later else None,
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in records),
            "recomputed_tokens": sum((r["prompt_tokens"] or 0) - (r["cached_tokens"] or 0)
                                     for r in records),
            "wall_s": info["wall_s"],
            "requests_per_replica": [int(r["requests"]) for r in info["replicas"]]}


def tables(summary: dict[str, dict[str, Any]]) -> list[Table]:
    rows = []
    for policy, s in summary.items():
        later = s["mean_ttft_later_turns_s"]
        rows.append([policy, f"{100 * s['cached_share']:.1f}%",
                     f"{100 * s['cached_share_later_turns']:.1f}%", f"{s['mean_ttft_s']:.2f} s",
                     f"{later:.2f} s" if later is not None else "n/a",
                     f"{s['recomputed_tokens']:,} of {s['prompt_tokens']:,}",
                     f"{s['wall_s']:.1f} s",
                     " / ".join(str(n) for n in s["requests_per_replica"])])
    return [Table("Per routing policy (every session and turn)",
                  ["policy", "cached-token share", "cached share, turns 2+", "mean TTFT",
                   "mean TTFT, turns 2+", "prompt tokens recomputed", "wall time",
                   "requests per replica"], rows,
                  note="cached-token share = sum of usage.prompt_tokens_details.cached_tokens / "
                       "sum of prompt_tokens. Requests per replica from each replica's /metrics.")]


def run(args: argparse.Namespace) -> int:
    if args.quick:
        apply_quick(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        print(f"unknown policies: {', '.join(unknown)}; known: {', '.join(POLICIES)}",
              file=sys.stderr)
        return 2
    model = model_files(args)
    system = AgenticText(SYSTEM_SEED).system_prompt(args.system_tokens)
    scripts = [session_script(args, s) for s in range(args.sessions)]
    records: list[dict[str, Any]] = []
    summary: dict[str, dict[str, Any]] = {}
    commands: dict[str, str] = {}
    for policy in policies:
        print(f"policy {policy}: {args.replicas} replicas, {args.sessions} sessions x "
              f"{args.turns} turns ...", file=sys.stderr, flush=True)
        rows, info = run_policy(args, policy, model, system, scripts)
        records += rows
        summary[policy] = {**policy_summary(rows, info), "replicas": info["replicas"]}
        commands.setdefault("replica", info["replica_command"])
        commands[f"router ({policy})"] = info["router_command"]
    report = Report(
        workload=NAME, command=command_line(),
        params={"model": model.name, "replicas": args.replicas, "sessions": args.sessions,
                "turns": args.turns, "system_tokens": args.system_tokens,
                "tool_tokens": args.tool_tokens, "answer_tokens": args.answer_tokens,
                "max_tokens": args.max_tokens, "parallel": args.parallel},
        servers={"replica": "rewind serve (prompt cache: RAM hot tier + disk tier), fresh for "
                            "each policy", "router": "sglang-router (python -m "
                            "sglang_router.launch_router), the policy named in each row"},
        fairness=["Same sessions, prompts and greedy decoding under every policy.",
                  "Fresh replicas (cold prompt caches) and a fresh router for each policy, each "
                  "replica warmed up with one short request sent to it directly.",
                  "The replicas share this machine's cores: a policy that spreads sessions does "
                  "not get more compute than one that piles them on one replica."],
        records=records, summary={"per_policy": summary}, tables=tables(summary),
        commands=commands)
    for path in report.write(args.out, out_stem(NAME, args.quick, args.tag)):
        print(path)
    return 0
