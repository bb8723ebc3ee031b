"""parallel-chat: four short chats sent at once, each stopping naturally, with the server at
--parallel 4 and at --parallel 1: the end-to-end time of the four, its ratio, and output tokens.

The seed's own benchmark (LM Studio's engine reported 2.2x), now side by side: every server runs
at both settings (llama-server with -np 4 and -np 1).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from rewind.bench.report import Report, Table, fmt_spread, spread
from rewind.bench.servers import ServerOptions, describe_server
from rewind.bench.sidebyside import (CONCURRENCY_NOTE, FAIRNESS, ServerRun, add_common_args,
                                     command_line, model_files, out_stem, run_servers,
                                     server_commands, server_log_dir, server_of, startup_table)

NAME = "parallel-chat"
CHATS = (
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "In two sentences, what does a compiler do?",
)


def register(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, default_servers="rewind,mlx-lm,llama.cpp", default_repeats=3)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="a safety cap only: the chats are meant to stop on their own")


def labels_for(servers: list[str], parallel: int) -> list[str]:
    return [label for name in servers for label in (f"{name}@p{parallel}", f"{name}@p1")]


def make_options(args: argparse.Namespace):
    def options_for(label: str) -> ServerOptions:
        parallel = int(label.split("@p", 1)[1]) if "@p" in label else 1
        return ServerOptions(parallel=parallel, context=4096,
                             extra_rewind_args=tuple(args.rewind_arg))

    return options_for


def make_workload(args: argparse.Namespace):
    def workload(run: ServerRun) -> list[dict[str, Any]]:
        bar = tqdm(total=len(CHATS), desc=f"{run.name} r{run.repeat}", unit="chat", leave=False)

        def one_chat(index: int) -> dict[str, Any]:
            timing = run.chat(run.client(), [{"role": "user", "content": CHATS[index]}],
                              max_tokens=args.max_tokens)
            bar.update(1)
            return {"chat": index, "ttft_s": timing.ttft_s, "e2e_s": timing.e2e_s,
                    "completion_tokens": timing.completion_tokens,
                    "finish_reason": timing.finish_reason, "text": timing.text}

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(CHATS)) as pool:
            rows = list(pool.map(one_chat, range(len(CHATS))))
        wall = time.perf_counter() - started
        bar.close()
        return [{**row, "batch_wall_s": wall} for row in rows]

    return workload


def summarize(records: list[dict[str, Any]], labels: list[str], parallel: int) -> tuple[dict, list[Table]]:
    walls: dict[str, dict[int, float]] = defaultdict(dict)
    tokens: dict[str, dict[int, int]] = defaultdict(dict)
    texts: dict[tuple[str, int], list[str]] = {}
    for record in records:
        walls[record["server"]][record["repeat"]] = record["batch_wall_s"]
        tokens[record["server"]][record["repeat"]] = (
            tokens[record["server"]].get(record["repeat"], 0) + (record["completion_tokens"] or 0))
        texts.setdefault((record["server"], record["repeat"]), [""] * len(CHATS))[record["chat"]] = record["text"]
    summary: dict[str, Any] = {}
    rows = []
    for label in labels:
        if label not in walls:
            continue
        repeats = sorted(walls[label])
        wall_values = [walls[label][r] for r in repeats]
        token_values = [tokens[label][r] for r in repeats]
        tps = [tokens[label][r] / walls[label][r] for r in repeats]
        entry = {"batch_wall_s": spread(wall_values), "output_tokens": spread(token_values),
                 "tokens_per_s": spread(tps)}
        speedup = "-"
        same_output = "-"
        serial_label = f"{server_of(label)}@p1"
        if label.endswith(f"@p{parallel}") and parallel != 1 and serial_label in walls:
            # Within one repeat: the same machine state for both.
            ratios = [walls[serial_label][r] / walls[label][r] for r in repeats
                      if r in walls[serial_label]]
            entry["speedup_vs_p1"] = spread(ratios)
            speedup = fmt_spread(spread(ratios), 2, "x")
            same = all(texts.get((label, r)) == texts.get((serial_label, r)) for r in repeats)
            entry["same_text_as_p1"] = same
            same_output = "yes" if same else "no"
        summary[label] = entry
        rows.append([label, fmt_spread(spread(wall_values), 1, " s"),
                     fmt_spread(spread(token_values), 0), fmt_spread(spread(tps), 1),
                     speedup, same_output])
    table = Table("Four short chats at once (median over repeats, min-max)",
                  ["server@parallel", "wall time of the four", "output tokens (sum)",
                   "output tok/s", f"speed-up p{parallel} vs p1", "same text as p1"], rows,
                  note="Each chat stops on its own end-of-turn token (max_tokens is only a cap). "
                       "Speed-up = wall time at --parallel 1 / at --parallel N, same repeat.")
    return summary, [table]


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.repeats, args.max_tokens = 1, 16  # tiny random models never stop on their own
    servers = [n.strip() for n in args.servers.split(",") if n.strip()]
    labels = labels_for(servers, args.parallel)
    model = model_files(args)

    def write(records: list[dict], runs: dict, notes: list[str]) -> list:
        summary, tables = summarize(records, labels, args.parallel)
        notes = list(notes)
        if any(r["finish_reason"] == "length" for r in records):
            notes.append("Some chats hit max_tokens instead of stopping naturally: "
                         f"{sum(r['finish_reason'] == 'length' for r in records)} of "
                         f"{len(records)}.")
        return Report(
            workload=NAME, command=command_line(),
            params={"model": model.name, "parallel": args.parallel,
                    "max_tokens": args.max_tokens, "repeats": args.repeats, "chats": len(CHATS)},
            servers={label: describe_server(server_of(label)) for label in labels},
            fairness=FAIRNESS + [CONCURRENCY_NOTE], records=records,
            summary={"per_server": summary, "runs": runs}, tables=[*tables, startup_table(runs)],
            notes=notes, commands=server_commands(runs)).write(
                args.out, out_stem(NAME, args.quick, args.tag))

    records, runs, notes = run_servers(args, labels, model, make_options(args), make_workload(args),
                                       calibrate_tokens=0, log_dir=server_log_dir(),
                                       on_progress=write)
    for path in write(records, runs, notes):
        print(path)
    return 0 if records else 1
