"""agentic: S concurrent agent sessions x T turns, side by side on each server.

Every session shares one ~2k-token system prompt with tool definitions; each turn appends the
previous assistant answer (its reasoning dropped, as agents do) and a tool result of a few hundred
tokens, so the prompt grows past 8k tokens. Per turn and server: time to first token, end-to-end
time, and prompt tokens recomputed: from usage.prompt_tokens_details.cached_tokens where the
server reports it, and derived from timing (TTFT x the server's own cold prefill rate).

--random-model SHAPE runs every server on random weights of a real shape (timing only, where no
weights can be fetched, e.g. a lent GPU machine): a bf16 folder for Rewind and its F16 GGUF for
llama-server (decode_scaling_models.build_served_model). Random weights never end a turn on
purpose, but may pick an end-of-sequence id, on one server and not another: every request then
bans those ids, so each turn generates --max-tokens tokens on every server (a note names any
turn that did not). Its tokenizer makes ~2.5x more tokens of the same text than a real one:
scale --system-tokens, --tool-tokens and --answer-tokens by 0.4 for the usual prompt sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rewind.bench.report import Plot, Report, Table, fmt_spread, spread
from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_served_model
from rewind.bench.servers import ModelFiles, ServerOptions, describe_server, resolve_model_files
from rewind.bench.sidebyside import (CONCURRENCY_NOTE, FAIRNESS, ServerRun, add_common_args,
                                     command_line, model_files, out_stem, run_servers,
                                     server_commands, server_log_dir, server_of, startup_table)
from rewind.bench.textgen import AgenticText, Turn, agent_messages

NAME = "agentic"
SYSTEM_SEED = 7  # the shared system prompt; sessions get seeds 100 + s


def register(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, default_servers="rewind,rewind-nocache,mlx-lm,llama.cpp",
                    default_repeats=2)
    parser.add_argument("--sessions", type=int, default=2, help="concurrent sessions (S)")
    parser.add_argument("--turns", type=int, default=12, help="turns per session (T)")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--tool-tokens", type=int, default=450,
                        help="mean tool-result size; each varies +-50%%")
    parser.add_argument("--answer-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32, help="generated per turn")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--random-model", choices=sorted({**SHAPES, **QUICK_SHAPES}),
                        default=None,
                        help="random weights of this shape in place of --model (bf16; for a "
                             "Llama shape an F16 GGUF beside them for llama-server); every "
                             "request bans the end-of-sequence ids")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where --random-model's folder is built, once (default: "
                             "~/.cache/rewind/bench-models/random)")


def apply_quick(args: argparse.Namespace) -> None:
    # The tiny model's byte-level tokenizer makes ~4x more tokens of the same text.
    args.sessions, args.turns, args.repeats = 2, 3, 1
    args.system_tokens, args.tool_tokens, args.answer_tokens, args.max_tokens = 80, 20, 10, 8
    args.context = 4096


def session_script(args: argparse.Namespace, session: int) -> tuple[str, list[Turn]]:
    """The task and the turns of one session: identical for every server."""
    text = AgenticText(100 + session)
    task = text.user_task()
    turns = []
    for _ in range(args.turns):
        size = int(args.tool_tokens * text.rng.uniform(0.5, 1.5))
        turns.append(text.turn(answer_tokens=args.answer_tokens, tool_tokens=size))
    return task, turns


def random_model_files(args: argparse.Namespace) -> ModelFiles:
    """--random-model's folder (built once) and, for a Llama shape, its model.gguf."""
    from rewind.paths import cache_home

    work_dir = args.work_dir or cache_home() / "bench-models" / "random"
    work_dir.mkdir(parents=True, exist_ok=True)
    folder = build_served_model(args.random_model, work_dir)
    files = resolve_model_files(str(folder))
    return ModelFiles(name=f"random {args.random_model}", mlx_folder=files.mlx_folder,
                      gguf=files.gguf)


def request_extras(args: argparse.Namespace, model: ModelFiles,
                   name: str) -> dict[str, Any] | None:
    """More request fields for server `name`: with random weights, the end-of-sequence ids
    banned. OpenAI's logit_bias for every server (-100, the most Rewind takes: a random model's
    logits span about +-10, so the id is never picked), and llama-server's own ignore_eos too
    (its -inf on every end-of-generation id it knows)."""
    if args.random_model is None:
        return None
    config = json.loads((model.mlx_folder / "config.json").read_text())
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    extra: dict[str, Any] = {"logit_bias": {str(int(token)): -100.0 for token in ids}}
    if server_of(name).startswith("llama.cpp"):
        extra["ignore_eos"] = True
    return extra


def make_workload(args: argparse.Namespace, system: str, scripts: list[tuple[str, list[Turn]]],
                  model: ModelFiles):
    def workload(run: ServerRun) -> list[dict[str, Any]]:
        bar = tqdm(total=len(scripts) * args.turns, desc=f"{run.name} r{run.repeat}",
                   unit="turn", leave=False)
        extra = request_extras(args, model, run.name)

        # One stream alone first: the server's idle decode step, the yardstick for the gaps
        # between a stream's tokens while other sessions prefill.
        idle = run.chat(run.client(), agent_messages(system, "Count to fifty.", []),
                        max_tokens=args.max_tokens, extra_body=extra)
        idle_row = {**turn_record(-1, -1, idle, None), "idle": True}

        def one_session(session: int) -> list[dict[str, Any]]:
            client = run.client()
            task, turns = scripts[session]
            rows = []
            for turn_index in range(args.turns):
                messages = agent_messages(system, task, turns[:turn_index])
                timing = run.chat(client, messages, max_tokens=args.max_tokens,
                                  extra_body=extra)
                rows.append(turn_record(session, turn_index, timing, run.prefill_tps))
                bar.update(1)
            return rows

        with ThreadPoolExecutor(max_workers=len(scripts)) as pool:
            results = list(pool.map(one_session, range(len(scripts))))
        bar.close()
        return [idle_row, *(row for rows in results for row in rows)]

    return workload


def turn_record(session: int, turn: int, timing, prefill_tps: float | None) -> dict[str, Any]:
    prompt = timing.prompt_tokens
    reported = (prompt - timing.cached_tokens
                if prompt is not None and timing.cached_tokens is not None else None)
    from_timing = (min(prompt, round(timing.ttft_s * prefill_tps))
                   if prompt is not None and prefill_tps else None)
    return {"session": session, "turn": turn, "ttft_s": timing.ttft_s, "e2e_s": timing.e2e_s,
            "prompt_tokens": prompt, "cached_tokens": timing.cached_tokens,
            "completion_tokens": timing.completion_tokens, "recomputed_reported": reported,
            "recomputed_from_timing": from_timing, "finish_reason": timing.finish_reason,
            "after_first_s": timing.e2e_s - timing.ttft_s, "token_gaps_s": timing.token_gaps_s}


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def summarize(records: list[dict[str, Any]], names: list[str], turns: int) -> tuple[dict, list[Table], list[Plot]]:
    idle = [r for r in records if r.get("idle")]
    records = [r for r in records if not r.get("idle")]
    by_server_turn: dict[tuple[str, int], list[dict]] = defaultdict(list)
    by_server_repeat: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for record in records:
        by_server_turn[(record["server"], record["turn"])].append(record)
        by_server_repeat[(record["server"], record["repeat"])].append(record)
    present = [n for n in names if any(r["server"] == n for r in records)]

    # Per turn: median TTFT over sessions and repeats.
    ttft_rows = []
    for turn in range(turns):
        prompt_sizes = [r["prompt_tokens"] for n in present for r in by_server_turn[(n, turn)]
                        if r["prompt_tokens"]]
        row: list[Any] = [turn + 1, int(statistics.median(prompt_sizes)) if prompt_sizes else "?"]
        for name in present:
            row.append(fmt_spread(spread([r["ttft_s"] for r in by_server_turn[(name, turn)]])))
        ttft_rows.append(row)

    # Per server: whole-run totals per repeat, then median/min-max over repeats.
    summary: dict[str, Any] = {}
    total_rows = []
    baseline = present[0] if present else None
    for name in present:
        repeats = sorted({r for (n, r) in by_server_repeat if n == name})
        totals = [sum(r["e2e_s"] for r in by_server_repeat[(name, rep)]) for rep in repeats]
        ttft_sums = [sum(r["ttft_s"] for r in by_server_repeat[(name, rep)]) for rep in repeats]
        recomputed_reported = [_sum_or_none(by_server_repeat[(name, rep)], "recomputed_reported")
                               for rep in repeats]
        recomputed_timing = [_sum_or_none(by_server_repeat[(name, rep)], "recomputed_from_timing")
                             for rep in repeats]
        prompt_totals = [_sum_or_none(by_server_repeat[(name, rep)], "prompt_tokens")
                         for rep in repeats]
        # Ratio against the first server, within the same repeat (same machine state).
        ratios = []
        for rep in repeats:
            if baseline and (baseline, rep) in by_server_repeat:
                base_total = sum(r["e2e_s"] for r in by_server_repeat[(baseline, rep)])
                ratios.append(sum(r["e2e_s"] for r in by_server_repeat[(name, rep)]) / base_total)
        summary[name] = {"total_e2e_s": spread(totals), "total_ttft_s": spread(ttft_sums),
                         "recomputed_reported": spread(recomputed_reported),
                         "recomputed_from_timing": spread(recomputed_timing),
                         "prompt_tokens": spread(prompt_totals),
                         f"e2e_ratio_vs_{baseline}": spread(ratios)}
        total_rows.append([name, fmt_spread(spread(totals), 1, " s"),
                           fmt_spread(spread(ttft_sums), 1, " s"),
                           fmt_spread(spread(prompt_totals), 0),
                           fmt_spread(spread(recomputed_reported), 0),
                           fmt_spread(spread(recomputed_timing), 0),
                           fmt_spread(spread(ratios), 2, "x")])
    stream_rows = []
    for name in present:
        repeats = sorted({r for (n, r) in by_server_repeat if n == name})
        # The mean gap, i.e. the time a token: with speculative decoding tokens come in
        # bursts, and the median gap of a stream alone is 0.
        idle_steps = [statistics.mean(r["token_gaps_s"]) for r in idle
                      if r["server"] == name and r["token_gaps_s"]]
        after_first = [statistics.mean(r["after_first_s"] for r in by_server_repeat[(name, rep)])
                       for rep in repeats]
        gaps = [[g for r in by_server_repeat[(name, rep)] for g in r.get("token_gaps_s") or []]
                for rep in repeats]
        p50 = [_percentile(g, 0.5) for g in gaps]
        p99 = [_percentile(g, 0.99) for g in gaps]
        idle_step = statistics.median(idle_steps) if idle_steps else None
        summary[name].update({"mean_after_first_token_s": spread(after_first),
                              "token_gap_p50_s": spread(p50), "token_gap_p99_s": spread(p99),
                              "idle_decode_step_s": idle_step})
        ratio = (spread([p / idle_step for p in p99 if p is not None])
                 if idle_step else spread([]))
        stream_rows.append([name, fmt_spread(spread(after_first), 2, " s"),
                            "n/a" if idle_step is None else f"{idle_step * 1000:.0f} ms",
                            fmt_spread(spread([p * 1000 for p in p50 if p is not None]), 0, " ms"),
                            fmt_spread(spread([p * 1000 for p in p99 if p is not None]), 0, " ms"),
                            fmt_spread(ratio, 1, "x")])
    tables = [
        Table("Whole run, per server (sum over sessions and turns; median over repeats, min-max)",
              ["server", "end-to-end", "sum of TTFT", "prompt tokens", "recomputed (reported)",
               "recomputed (from timing)", f"time vs {baseline}"], total_rows,
              note="`recomputed (reported)` = prompt_tokens - usage.prompt_tokens_details."
                   "cached_tokens; n/a where the server does not report it. `from timing` = "
                   "TTFT x the server's cold prefill rate, capped at the prompt size."),
        Table("Streaming after the first token (median over repeats, min-max)",
              ["server", "mean time after the first token, per turn", "idle decode step",
               "gap between tokens, p50", "gap between tokens, p99", "p99 gap / idle step"],
              stream_rows,
              note="The idle decode step is the mean gap of one stream alone, measured on the "
                   "same server just before the sessions start. Gaps are between consecutive "
                   "streamed chunks with text, over every turn of every session."),
        Table("Time to first token per turn, seconds (median over sessions and repeats, min-max)",
              ["turn", "prompt tokens", *present], ttft_rows),
    ]
    series = {}
    for name in present:
        xs, ys = [], []
        for turn in range(turns):
            values = [r["ttft_s"] for r in by_server_turn[(name, turn)]]
            if values:
                xs.append(turn + 1)
                ys.append(statistics.median(values))
        series[name] = (xs, ys)
    plots = [Plot("ttft.png", "Agentic sessions: time to first token per turn",
                  "turn", "TTFT, s (median)", series, logy=True)]
    return summary, tables, plots


def short_turns(records: list[dict[str, Any]], max_tokens: int) -> list[str]:
    """A note per server with turns that generated other than max_tokens tokens: their decode
    time is not comparable with another server's full turns."""
    short: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        if not record.get("idle") and record["completion_tokens"] != max_tokens:
            short[record["server"]].append(record)
    return [f"{name}: {len(rows)} turns generated other than {max_tokens} tokens (finish "
            f"reasons {sorted({str(r['finish_reason']) for r in rows})}, completion tokens "
            f"{sorted({r['completion_tokens'] for r in rows}, key=str)})"
            for name, rows in short.items()]


def _sum_or_none(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows]
    if any(v is None for v in values):
        return None
    return float(sum(values))


def run(args: argparse.Namespace) -> int:
    if args.quick:
        apply_quick(args)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    model = random_model_files(args) if args.random_model else model_files(args)
    system = AgenticText(SYSTEM_SEED).system_prompt(args.system_tokens)
    scripts = [session_script(args, s) for s in range(args.sessions)]
    options = ServerOptions(parallel=args.parallel, context=args.context,
                            extra_rewind_args=tuple(args.rewind_arg))
    log_dir = server_log_dir()

    fairness = FAIRNESS + [CONCURRENCY_NOTE]
    gguf = "the Q4_K_M GGUF"
    if args.random_model:
        gguf = "the F16 GGUF of the same random weights"
        fairness = [f"Same weights: random ones of the {args.random_model} shape, bf16 for "
                    "Rewind, the same values as an F16 GGUF for llama-server (timing only: the "
                    "text is random).",
                    *FAIRNESS[1:], CONCURRENCY_NOTE,
                    "Every request bans the end-of-sequence ids (logit_bias -100; llama-server "
                    "also ignore_eos), so every turn generates max_tokens tokens."]

    def write(records: list[dict], runs: dict, notes: list[str]) -> list:
        summary, tables, plots = summarize(records, names, args.turns)
        return Report(
            workload=NAME, command=command_line(),
            params={"model": model.name, "sessions": args.sessions, "turns": args.turns,
                    "system_tokens": args.system_tokens, "tool_tokens": args.tool_tokens,
                    "answer_tokens": args.answer_tokens, "max_tokens": args.max_tokens,
                    "parallel": args.parallel, "repeats": args.repeats,
                    "random_model": args.random_model},
            servers={n: describe_server(n, gguf) for n in names},
            fairness=fairness,
            records=records, summary={"per_server": summary, "runs": runs},
            tables=[*tables, startup_table(runs)], plots=plots,
            notes=[*notes, *short_turns(records, args.max_tokens)],
            commands=server_commands(runs)).write(
                args.out, out_stem(NAME, args.quick, args.tag))

    records, runs, notes = run_servers(
        args, names, model, lambda name: options, make_workload(args, system, scripts, model),
        calibrate_tokens=32 if args.quick else 1024, log_dir=log_dir, on_progress=write)
    for path in write(records, runs, notes):
        print(path)
    return 0 if records else 1
