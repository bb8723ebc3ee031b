"""edits: source files asked back with one small change, alone and from concurrent sessions, side
by side on each server: the copy-heavy output speculative decoding is for.

The files are real: the first lines of modules of an installed package (mlx-lm, which every
Rewind install has), not text written here. Each request shows one worked example (a file and
the same file with a name changed, as an earlier turn of the chat) and then asks for another file
back with another name changed. Greedy, streamed, `--max-tokens` each. Measured per request:
time to first token and the time after it; and, where the server reports them (Rewind's
usage.completion_tokens_details), drafted tokens accepted and rejected.

Each mode runs every file once: `alone` one request at a time, `sessions` S sessions at once,
each going through the files in its own order. Ratios are against `rewind-nospec` (the same
server decoding one token a step) and against `llama.cpp-spec` (llama-server with its own n-gram
speculation) within the same repeat.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rewind.bench.report import Report, Table, fmt_spread, spread
from rewind.bench.servers import ServerOptions, describe_server
from rewind.bench.sidebyside import (CONCURRENCY_NOTE, FAIRNESS, ServerRun, add_common_args,
                                     command_line, model_files, out_stem, run_servers,
                                     server_commands, server_log_dir, startup_table)

NAME = "edits"
PACKAGE = "mlx_lm"
# (module file in the package, the name the request renames, its new name)
EDITS = (
    ("sample_utils.py", "make_sampler", "build_sampler"),
    ("models/rope_utils.py", "SuScaledRoPE", "SuScaledRotaryEmbedding"),
    ("models/base.py", "create_causal_mask", "causal_mask"),
    ("models/llama.py", "ModelArgs", "LlamaArgs"),
    ("models/activations.py", "swiglu", "swi_glu"),
    ("tokenizer_utils.py", "StreamingDetokenizer", "StreamDetokenizer"),
    ("models/gemma3_text.py", "ModelArgs", "Gemma3Args"),
)
EXAMPLE = 0  # the worked example every request shows; the others are asked for
MODES = ("alone", "sessions")


def register(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser, default_servers="rewind,rewind-nospec,llama.cpp,llama.cpp-spec,mlx-lm",
                    default_repeats=1)
    parser.add_argument("--sessions", type=int, default=3, help="concurrent sessions (S)")
    parser.add_argument("--lines", type=int, default=40,
                        help="lines of each file shown and asked back (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="generated per request (default: %(default)s)")
    parser.add_argument("--files", type=int, default=len(EDITS) - 1,
                        help="files asked for, besides the worked example (default: all, "
                        f"{len(EDITS) - 1})")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--context", type=int, default=8192)


def apply_quick(args: argparse.Namespace) -> None:
    args.sessions, args.lines, args.max_tokens, args.files, args.repeats = 2, 12, 24, 2, 1
    args.context = 4096


def package_files(lines: int) -> list[tuple[str, str, str, str]]:
    """(file, text, old name, new name) of each edit whose file has the name in its first
    `lines` lines, from the installed package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the edits workload reads {PACKAGE}'s files; it is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    out = []
    for name, old, new in EDITS:
        path = root / name
        if not path.exists():
            continue
        text = "\n".join(path.read_text().splitlines()[:lines])
        if old in text:
            out.append((name, text, old, new))
    return out


def ask(text: str, old: str, new: str) -> str:
    return (f"Here is a Python file.\n\n```python\n{text}\n```\n\nWrite the whole file again, "
            f"unchanged except that `{old}` is renamed to `{new}`. Answer with the file only, "
            "in one code block.")


def edit_messages(example: tuple[str, str, str, str],
                  asked: tuple[str, str, str, str]) -> list[dict[str, str]]:
    _, text, old, new = example
    _, asked_text, asked_old, asked_new = asked
    return [{"role": "user", "content": ask(text, old, new)},
            {"role": "assistant", "content": f"```python\n{text.replace(old, new)}\n```"},
            {"role": "user", "content": ask(asked_text, asked_old, asked_new)}]


def copied_share(answer: str, expected: str) -> float:
    """Lines of the expected file the answer holds, in order (a longest common subsequence of
    lines over the expected file's, up to where the answer stops)."""
    want = [line for line in expected.splitlines() if line.strip()]
    got = [line for line in answer.splitlines() if line.strip()]
    if not want:
        return 0.0
    previous = [0] * (len(got) + 1)
    for w in want:
        row = [0] * (len(got) + 1)
        for j, g in enumerate(got, 1):
            row[j] = previous[j - 1] + 1 if w == g else max(previous[j], row[j - 1])
        previous = row
    return previous[-1] / len(want)


def make_workload(args: argparse.Namespace, files: list[tuple[str, str, str, str]]):
    example, asked = files[EXAMPLE], files[1:1 + args.files]

    def request(run: ServerRun, client, mode: str, session: int, index: int) -> dict[str, Any]:
        name, text, old, new = asked[index]
        timing = run.chat(client, edit_messages(example, asked[index]),
                          max_tokens=args.max_tokens)
        return {"mode": mode, "session": session, "file": name, "ttft_s": timing.ttft_s,
                "e2e_s": timing.e2e_s, "after_first_s": timing.e2e_s - timing.ttft_s,
                "prompt_tokens": timing.prompt_tokens,
                "completion_tokens": timing.completion_tokens,
                "accepted": timing.accepted_prediction_tokens,
                "rejected": timing.rejected_prediction_tokens,
                "copied": copied_share(timing.text, text.replace(old, new)),
                "text": timing.text}

    def workload(run: ServerRun) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        bar = tqdm(total=len(asked) * (1 + args.sessions), desc=f"{run.name} r{run.repeat}",
                   unit="request", leave=False)
        client = run.client()
        for index in range(len(asked)):
            rows.append(request(run, client, "alone", 0, index))
            bar.update(1)

        def one_session(session: int) -> list[dict[str, Any]]:
            session_client = run.client()
            out = []
            for step in range(len(asked)):
                out.append(request(run, session_client, "sessions", session,
                                   (step + session) % len(asked)))
                bar.update(1)
            return out

        with ThreadPoolExecutor(max_workers=args.sessions) as pool:
            for session_rows in pool.map(one_session, range(args.sessions)):
                rows.extend(session_rows)
        bar.close()
        return rows

    return workload


def summarize(records: list[dict[str, Any]], names: list[str]) -> tuple[dict, list[Table]]:
    by_key: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for record in records:
        by_key[(record["server"], record["mode"], record["repeat"])].append(record)
    present = [n for n in names if any(r["server"] == n for r in records)]
    summary: dict[str, Any] = {}
    rows = []
    for mode in MODES:
        for name in present:
            repeats = sorted({rep for (n, m, rep) in by_key if n == name and m == mode})
            after = [sum(r["after_first_s"] for r in by_key[(name, mode, rep)]) for rep in repeats]
            ttft = [sum(r["ttft_s"] for r in by_key[(name, mode, rep)]) for rep in repeats]
            tokens = [sum(r["completion_tokens"] or 0 for r in by_key[(name, mode, rep)])
                      for rep in repeats]
            ratios: dict[str, list[float]] = {}
            for base in ("rewind-nospec", "llama.cpp-spec", "llama.cpp"):
                for rep in repeats:
                    base_rows = by_key.get((base, mode, rep))
                    if base_rows:
                        base_after = sum(r["after_first_s"] for r in base_rows)
                        ratios.setdefault(base, []).append(
                            sum(r["after_first_s"] for r in by_key[(name, mode, rep)]) / base_after)
            accepted = [r["accepted"] for rep in repeats for r in by_key[(name, mode, rep)]
                        if r["accepted"] is not None]
            rejected = [r["rejected"] for rep in repeats for r in by_key[(name, mode, rep)]
                        if r["rejected"] is not None]
            copied = [r["copied"] for rep in repeats for r in by_key[(name, mode, rep)]]
            drafted = sum(accepted) + sum(rejected)
            summary.setdefault(name, {})[mode] = {
                "after_first_token_s": spread(after), "ttft_s": spread(ttft),
                "completion_tokens": spread(tokens),
                **{f"after_first_vs_{base}": spread(v) for base, v in ratios.items()},
                "accepted_tokens": sum(accepted), "drafted_tokens": drafted,
                "copied_share": statistics.mean(copied) if copied else None}
            rows.append([mode, name, fmt_spread(spread(after), 1, " s"),
                         fmt_spread(spread(ttft), 1, " s"), fmt_spread(spread(tokens), 0),
                         *(fmt_spread(spread(ratios.get(base, [])), 2, "x")
                           for base in ("rewind-nospec", "llama.cpp-spec")),
                         f"{sum(accepted)} / {drafted}" if drafted else "n/a",
                         f"{statistics.mean(copied):.2f}" if copied else "n/a"])
    same = _same_answers(records)
    tables = [Table(
        "Time after the first token, summed over the requests of a mode (median over repeats)",
        ["mode", "server", "after first token", "sum of TTFT", "tokens", "vs rewind-nospec",
         "vs llama.cpp-spec", "accepted / drafted", "copied share"], rows,
        note="`alone`: one request at a time; `sessions`: S sessions at once, each through every "
             "file. `copied share`: the expected file's non-empty lines found in order in the "
             "answer, averaged over requests (how faithfully the model copies, whatever the "
             "server). `accepted / drafted`: from usage.completion_tokens_details where the "
             "server reports it.")]
    if same:
        tables.append(Table("Same answers as rewind-nospec (greedy)", ["server", "mode",
                                                                        "identical / requests"],
                            same, note="Speculation must not change a greedy answer."))
    return summary, tables


def _same_answers(records: list[dict[str, Any]]) -> list[list[Any]]:
    base = {(r["mode"], r["session"], r["file"], r["repeat"]): r["text"] for r in records
            if r["server"] == "rewind-nospec"}
    if not base:
        return []
    out = []
    for name in sorted({r["server"] for r in records if r["server"].startswith("rewind")}
                       - {"rewind-nospec"}):
        for mode in MODES:
            mine = [r for r in records if r["server"] == name and r["mode"] == mode]
            same = sum(1 for r in mine
                       if base.get((r["mode"], r["session"], r["file"], r["repeat"])) == r["text"])
            out.append([name, mode, f"{same} / {len(mine)}"])
    return out


def run(args: argparse.Namespace) -> int:
    if args.quick:
        apply_quick(args)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    model = model_files(args)
    files = package_files(args.lines)
    if len(files) < 2:
        raise SystemExit(f"too few of the edit files found in the installed {PACKAGE}")
    options = ServerOptions(parallel=args.parallel, context=args.context,
                            extra_rewind_args=tuple(args.rewind_arg))

    def write(records: list[dict], runs: dict, notes: list[str]) -> list:
        summary, tables = summarize(records, names)
        return Report(
            workload=NAME, command=command_line(),
            params={"model": model.name, "sessions": args.sessions, "lines": args.lines,
                    "max_tokens": args.max_tokens, "files": [f[0] for f in files],
                    "package": PACKAGE, "parallel": args.parallel, "repeats": args.repeats},
            servers={n: describe_server(n) for n in names},
            fairness=FAIRNESS + [CONCURRENCY_NOTE],
            records=records, summary={"per_server": summary, "runs": runs},
            tables=[*tables, startup_table(runs)], notes=notes,
            commands=server_commands(runs)).write(args.out, out_stem(NAME, args.quick, args.tag))

    records, runs, notes = run_servers(args, names, model, lambda name: options,
                                       make_workload(args, files), calibrate_tokens=0,
                                       log_dir=server_log_dir(), on_progress=write)
    for path in write(records, runs, notes):
        print(path)
    return 0 if records else 1
