"""long-prompts-memory: four ~4k-token prompts at once at --parallel 4; the server's RSS (process
and children) after load, after the run and over time, with Rewind's disk tier and with its
prompt cache kept entirely in RAM, side by side with mlx-lm and llama.cpp.

The seed's own benchmark (LM Studio's engine reported 82% less extra RAM with its disk tier).
"""

from __future__ import annotations

import argparse
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

NAME = "long-prompts-memory"
MIB = 1 << 20


def register(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, default_servers="rewind,rewind-ram,mlx-lm,llama.cpp",
                    default_repeats=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--hot-ram", default="64MiB",
                        help="Rewind's RAM hot tier when the disk tier is on (row `rewind`)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds after the run before the last RSS reading")


def make_options(args: argparse.Namespace):
    def options_for(label: str) -> ServerOptions:
        extra: tuple[str, ...] = ()
        if label == "rewind":
            extra = ("--cache-ram", args.hot_ram)
        elif label == "rewind-ram":
            extra = ("--cache-ram", "16GiB")  # with --no-disk-cache: everything stays in RAM
        return ServerOptions(parallel=args.parallel, context=8192,
                             extra_rewind_args=(*extra, *args.rewind_arg))

    return options_for


def make_workload(args: argparse.Namespace, prompts: list[str]):
    def workload(run: ServerRun) -> list[dict[str, Any]]:
        bar = tqdm(total=len(prompts), desc=f"{run.name} r{run.repeat}", unit="prompt",
                   leave=False)

        def one(index: int) -> dict[str, Any]:
            timing = run.chat(run.client(), [{"role": "user", "content": prompts[index]}],
                              max_tokens=args.max_tokens)
            bar.update(1)
            return {"prompt": index, "ttft_s": timing.ttft_s, "e2e_s": timing.e2e_s,
                    "prompt_tokens": timing.prompt_tokens,
                    "completion_tokens": timing.completion_tokens}

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            rows = list(pool.map(one, range(len(prompts))))
        bar.close()
        return rows

    return workload


def summarize(records: list[dict[str, Any]], runs: dict[str, Any], labels: list[str]):
    by_label: dict[str, list[dict]] = defaultdict(list)
    for info in runs.values():
        by_label[info["server"]].append(info)
    summary: dict[str, Any] = {}
    rows = []
    series: dict[str, tuple[list[float], list[float]]] = {}
    for label in labels:
        infos = by_label.get(label)
        if not infos:
            continue
        loaded = [i["rss_marks"]["loaded"][1] / MIB for i in infos]
        after = [i["rss_marks"]["after run"][1] / MIB for i in infos]
        settled = [i["rss_marks"]["settled"][1] / MIB for i in infos]
        peak = [i["rss_peak"] / MIB for i in infos]
        extra = [i["rss_marks"]["settled"][1] / MIB - i["rss_marks"]["loaded"][1] / MIB
                 for i in infos]
        extra_peak = [i["rss_peak"] / MIB - i["rss_marks"]["loaded"][1] / MIB for i in infos]
        wall = [i["workload_s"] for i in infos]
        summary[label] = {"rss_loaded_mib": spread(loaded), "rss_after_mib": spread(after),
                          "rss_settled_mib": spread(settled), "rss_peak_mib": spread(peak),
                          "extra_after_mib": spread(extra), "extra_peak_mib": spread(extra_peak),
                          "wall_s": spread(wall)}
        rows.append([label, fmt_spread(spread(loaded), 0), fmt_spread(spread(after), 0),
                     fmt_spread(spread(settled), 0), fmt_spread(spread(peak), 0),
                     fmt_spread(spread(extra), 0), fmt_spread(spread(extra_peak), 0),
                     fmt_spread(spread(wall), 1, " s")])
        first = min(infos, key=lambda i: i["repeat"])
        start = first["rss_marks"]["before run"][0]
        series[label] = ([t - start for t, _ in first["rss_series"]],
                         [rss / MIB for _, rss in first["rss_series"]])
    ratio_rows = []
    if "rewind" in summary and "rewind-ram" in summary:
        disk, ram = summary["rewind"]["extra_after_mib"], summary["rewind-ram"]["extra_after_mib"]
        if disk["median"] is not None and ram["median"]:
            saving = 1 - disk["median"] / ram["median"]
            summary["extra_ram_saved_by_disk_tier"] = saving
            ratio_rows.append(["rewind (disk tier) vs rewind-ram", f"{saving:.0%}"])
    tables = [Table("Server RSS, MiB (process + children; median over repeats, min-max)",
                    ["server", "after load", "after run", f"settled", "peak",
                     "extra after run (settled - load)", "extra at peak", "run time"], rows,
                    note="`after load` is read after a warm-up request; `settled` a few seconds "
                         "after the last response, once background writers are done.")]
    if ratio_rows:
        tables.append(Table("Extra RAM saved by the disk tier", ["comparison", "saved"],
                            ratio_rows))
    plots = [Plot("rss.png", "RSS over time, four long prompts at once (first repeat)",
                  "seconds since the prompts were sent", "RSS, MiB", series)]
    return summary, tables, plots


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.repeats, args.prompt_tokens, args.max_tokens, args.settle = 1, 150, 4, 0.5
    labels = [n.strip() for n in args.servers.split(",") if n.strip()]
    model = model_files(args)
    prompts = [AgenticText(500 + i).long_document(args.prompt_tokens)
               + "\n\nSummarize the text above in one paragraph." for i in range(args.prompts)]

    def write(records: list[dict], runs: dict, notes: list[str]) -> list:
        summary, tables, plots = summarize(records, runs, labels)
        return Report(
            workload=NAME, command=command_line(),
            params={"model": model.name, "prompts": args.prompts,
                    "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                    "parallel": args.parallel, "hot_ram": args.hot_ram,
                    "repeats": args.repeats},
            servers={label: describe_server(server_of(label)) for label in labels},
            fairness=FAIRNESS + [CONCURRENCY_NOTE], records=records,
            summary={"per_server": summary, "runs": runs},
            tables=[*tables, startup_table(runs)], plots=plots,
            notes=notes, commands=server_commands(runs)).write(
                args.out, out_stem(NAME, args.quick, args.tag))

    records, runs, notes = run_servers(args, labels, model, make_options(args),
                                       make_workload(args, prompts), calibrate_tokens=0,
                                       log_dir=server_log_dir(), settle_s=args.settle,
                                       on_progress=write)
    for path in write(records, runs, notes):
        print(path)
    return 0 if records else 1
