"""multi-round-qa: U users x R rounds, as LMCache's multi-round QA benchmark does.

All users share one system prompt; each user starts with a history of its own (a long document),
then asks a question per round; the server's own answer joins that user's history, so each round
resends everything before it. Users run concurrently. Per round and server: time to first token,
end-to-end time, cached tokens where reported.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from rewind.bench.report import Plot, Report, Table, fmt_spread, spread
from rewind.bench.servers import ServerOptions, describe_server
from rewind.bench.sidebyside import (CONCURRENCY_NOTE, FAIRNESS, ServerRun, add_common_args,
                                     command_line, model_files, out_stem, run_servers,
                                     server_commands, server_log_dir, server_of, startup_table)
from rewind.bench.textgen import AgenticText

NAME = "multi-round-qa"


def register(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, default_servers="rewind,rewind-nocache,mlx-lm,llama.cpp",
                    default_repeats=2)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--history-tokens", type=int, default=1000,
                        help="each user's own document, before the first question")
    parser.add_argument("--question-tokens", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=48, help="answer length")
    parser.add_argument("--parallel", type=int, default=4)


def user_script(args: argparse.Namespace, user: int) -> tuple[str, list[str]]:
    text = AgenticText(300 + user)
    history = text.long_document(args.history_tokens)
    questions = [text.question(args.question_tokens) for _ in range(args.rounds)]
    return history, questions


def make_workload(args: argparse.Namespace, system: str, scripts: list[tuple[str, list[str]]]):
    def workload(run: ServerRun) -> list[dict[str, Any]]:
        bar = tqdm(total=len(scripts) * args.rounds, desc=f"{run.name} r{run.repeat}",
                   unit="round", leave=False)

        def one_user(user: int) -> list[dict[str, Any]]:
            client = run.client()
            history, questions = scripts[user]
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Here is my document:\n{history}\n\n"
                                                    f"{questions[0]}"}]
            rows = []
            for round_index in range(args.rounds):
                if round_index > 0:
                    messages.append({"role": "user", "content": questions[round_index]})
                timing = run.chat(client, messages, max_tokens=args.max_tokens)
                # The server's own answer joins the history, as a chat client does.
                messages.append({"role": "assistant", "content": timing.text})
                rows.append({"user": user, "round": round_index, "ttft_s": timing.ttft_s,
                             "e2e_s": timing.e2e_s, "prompt_tokens": timing.prompt_tokens,
                             "cached_tokens": timing.cached_tokens,
                             "completion_tokens": timing.completion_tokens})
                bar.update(1)
            return rows

        with ThreadPoolExecutor(max_workers=len(scripts)) as pool:
            results = list(pool.map(one_user, range(len(scripts))))
        bar.close()
        return [row for rows in results for row in rows]

    return workload


def summarize(records: list[dict[str, Any]], labels: list[str], rounds: int):
    by_round: dict[tuple[str, int], list[dict]] = defaultdict(list)
    by_repeat: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for record in records:
        by_round[(record["server"], record["round"])].append(record)
        by_repeat[(record["server"], record["repeat"])].append(record)
    present = [label for label in labels if any(r["server"] == label for r in records)]
    baseline = present[0] if present else None
    summary: dict[str, Any] = {}
    total_rows = []
    for label in present:
        repeats = sorted({rep for (name, rep) in by_repeat if name == label})
        mean_ttft = [statistics.mean(r["ttft_s"] for r in by_repeat[(label, rep)])
                     for rep in repeats]
        cached_share = []
        for rep in repeats:
            rows = by_repeat[(label, rep)]
            if all(r["cached_tokens"] is not None and r["prompt_tokens"] for r in rows):
                cached_share.append(sum(r["cached_tokens"] for r in rows)
                                    / sum(r["prompt_tokens"] for r in rows))
        ratios = [statistics.mean(r["ttft_s"] for r in by_repeat[(label, rep)])
                  / statistics.mean(r["ttft_s"] for r in by_repeat[(baseline, rep)])
                  for rep in repeats if (baseline, rep) in by_repeat]
        summary[label] = {"mean_ttft_s": spread(mean_ttft), "cached_share": spread(cached_share),
                          f"ttft_ratio_vs_{baseline}": spread(ratios)}
        total_rows.append([label, fmt_spread(spread(mean_ttft), 2, " s"),
                           fmt_spread(spread(cached_share), 2) if cached_share else "n/a",
                           fmt_spread(spread(ratios), 2, "x")])
    round_rows = []
    for round_index in range(rounds):
        sizes = [r["prompt_tokens"] for label in present for r in by_round[(label, round_index)]
                 if r["prompt_tokens"]]
        round_rows.append([round_index + 1, int(statistics.median(sizes)) if sizes else "?"] + [
            fmt_spread(spread([r["ttft_s"] for r in by_round[(label, round_index)]]))
            for label in present])
    tables = [
        Table("Per server (median over repeats, min-max)",
              ["server", "mean TTFT", "share of prompt tokens cached (reported)",
               f"TTFT vs {baseline}"], total_rows),
        Table("Time to first token per round, seconds (median over users and repeats, min-max)",
              ["round", "prompt tokens", *present], round_rows),
    ]
    series = {}
    for label in present:
        xs = [i + 1 for i in range(rounds) if by_round[(label, i)]]
        ys = [statistics.median(r["ttft_s"] for r in by_round[(label, i)])
              for i in range(rounds) if by_round[(label, i)]]
        series[label] = (xs, ys)
    plots = [Plot("ttft.png", "Multi-round QA: time to first token per round", "round",
                  "TTFT, s (median)", series, logy=True)]
    return summary, tables, plots


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.users, args.rounds, args.repeats = 2, 2, 1
        args.system_tokens, args.history_tokens, args.question_tokens, args.max_tokens = (
            60, 60, 15, 8)
    labels = [n.strip() for n in args.servers.split(",") if n.strip()]
    model = model_files(args)
    system = AgenticText(11).system_prompt(args.system_tokens)
    scripts = [user_script(args, u) for u in range(args.users)]
    options = ServerOptions(parallel=args.parallel, context=16384,
                            extra_rewind_args=tuple(args.rewind_arg))

    def write(records: list[dict], runs: dict, notes: list[str]) -> list:
        summary, tables, plots = summarize(records, labels, args.rounds)
        return Report(
            workload=NAME, command=command_line(),
            params={"model": model.name, "users": args.users, "rounds": args.rounds,
                    "system_tokens": args.system_tokens, "history_tokens": args.history_tokens,
                    "question_tokens": args.question_tokens, "max_tokens": args.max_tokens,
                    "parallel": args.parallel, "repeats": args.repeats},
            servers={label: describe_server(server_of(label)) for label in labels},
            fairness=FAIRNESS + [CONCURRENCY_NOTE,
                                 "Each server's own answers join the history, so later prompts "
                                 "differ slightly between servers (token counts are reported)."],
            records=records, summary={"per_server": summary, "runs": runs},
            tables=[*tables, startup_table(runs)],
            plots=plots, notes=notes, commands=server_commands(runs)).write(
                args.out, out_stem(NAME, args.quick, args.tag))

    records, runs, notes = run_servers(args, labels, model, lambda label: options,
                                       make_workload(args, system, scripts),
                                       calibrate_tokens=0, log_dir=server_log_dir(),
                                       on_progress=write)
    for path in write(records, runs, notes):
        print(path)
    return 0 if records else 1
