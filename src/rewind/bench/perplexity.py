"""Perplexity of one GGUF on one text: Rewind in each CPU weight form vs llama.cpp's
`llama-perplexity` (issue 25: Rewind's in-place GGUF must be within 0.5% of it).

Rewind's side uses llama-perplexity's own method (rewind.models.quality.chunked_perplexity): the
text tokenized whole, chunks of n_ctx tokens with BOS first, each evaluated from scratch, the
second half of each scored. Both read the same text file, so the numbers compare; the tokens do
too (llama.cpp's tokenizer and Rewind's give the same ids for the default text, checked with
llama-tokenize).

    in-place   the GGUF's blocks read in place by Rewind's C kernels (--cpu-weights gguf)
    exact      the MLX folder converted from the GGUF: bf16 layers, float32 compute (exact)
    int8       int8 layers and head, one scale per row (--cpu-weights int8)
    llama.cpp  `llama-perplexity -m GGUF -f TEXT -c N` (--llama-cpp; built by
               scripts/install-llama-cpp.sh)

The default text is benchmarks/data/fsf-licenses.txt (four FSF licenses, ~22k tokens; nothing is
downloaded). Writes benchmarks/results/perplexity.json and .md.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TEXT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "fsf-licenses.txt"
# Form -> load_model's keyword arguments.
FORMS: dict[str, dict[str, Any]] = {
    "in-place": {"in_place": True},
    "exact": {"in_place": False},
    "int8": {"native_forward": "int8", "cpu_head": "int8", "in_place": False},
}
FORM_NOTES = {
    "in-place": "the GGUF's Q4_K_M / Q6_K blocks read in place (`--cpu-weights gguf`)",
    "exact": "the MLX folder converted from the GGUF, bf16 layers, float32 compute "
             "(`--cpu-weights exact`)",
    "int8": "int8 layers and head, one scale per row (`--cpu-weights int8`)",
}
TOLERANCE = 0.005  # issue 25: within 0.5% of llama-perplexity

_NUMBER = r"([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf))"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="registry name or folder; its GGUF is the one measured")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF (default: the one the model came from)")
    parser.add_argument("--text", type=Path, default=TEXT,
                        help="the text file (default benchmarks/data/fsf-licenses.txt)")
    parser.add_argument("--ctx", type=int, default=512,
                        help="tokens per chunk, llama-perplexity's -c (default 512)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="the first chunks only, llama-perplexity's --chunks (default all)")
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS),
                        help=f"Rewind's CPU weight forms to measure (default {' '.join(FORMS)})")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama-perplexity (built by scripts/install-llama-cpp.sh)")
    parser.add_argument("--install-llama-cpp", action="store_true",
                        help="build llama.cpp's binaries if missing (scripts/install-llama-cpp.sh)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--stem", default="perplexity", help="results file name (no suffix)")


# --- llama-perplexity ----------------------------------------------------------------------------
def llama_perplexity_argv(gguf: Path, text: Path, n_ctx: int, chunks: int | None) -> list[str]:
    """llama-perplexity as a user runs it: the file, the text, the context; its defaults else."""
    from rewind.bench.servers import llama_cpp_binary

    argv = [str(llama_cpp_binary("llama-perplexity")), "-m", str(gguf), "-f", str(text),
            "-c", str(n_ctx)]
    return argv + (["--chunks", str(chunks)] if chunks is not None else [])


def parse_llama_perplexity(output: str) -> dict[str, Any]:
    """What llama-perplexity printed: its final estimate and `+/-`, the running perplexity after
    each chunk (`[i]value,`), and how many chunks of what n_ctx it computed over."""
    final = re.search(rf"Final estimate: PPL = {_NUMBER} \+/- {_NUMBER}", output)
    if final is None:
        raise ValueError("no `Final estimate: PPL = X +/- Y` in llama-perplexity's output: "
                         + " | ".join(output.strip().splitlines()[-3:]))
    plan = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", output)
    running = [float(value) for _, value in re.findall(rf"\[(\d+)\]{_NUMBER},", output)]
    return {"ppl": float(final.group(1)), "error": float(final.group(2)), "running": running,
            "chunks": int(plan.group(1)) if plan else len(running),
            "n_ctx": int(plan.group(2)) if plan else None}


def run_llama_perplexity(argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          errors="replace")
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {output[-2000:]}")
    return {**parse_llama_perplexity(output), "seconds": round(seconds, 1)}


# --- Rewind --------------------------------------------------------------------------------------
def adds_bos(tokenizer: Any) -> int | None:
    """The BOS id where the tokenizer puts one before a text (llama.cpp's add_bos), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    probe = tokenizer.encode("a")
    return bos if bos is not None and probe and probe[0] == bos else None


def measure_form(model_name: str, form: str, text: str, n_ctx: int,
                 chunks: int | None) -> dict[str, Any]:
    import mlx.core as mx

    from rewind.kernels.native_forward import native_forward
    from rewind.models.loader import load_model
    from rewind.models.quality import chunked_perplexity

    started = time.perf_counter()
    loaded = load_model(model_name, **FORMS[form])
    forward = native_forward(loaded.model)
    weights = getattr(forward, "form", None) or "MLX"
    if form == "in-place" and weights != "gguf":
        raise SystemExit(f"{model_name}: the in-place form did not load in place "
                         f"(weights: {weights}); is there a GGUF beside the model?")
    tokens = loaded.tokenizer.encode(text)
    bos = adds_bos(loaded.tokenizer)
    load_seconds = time.perf_counter() - started

    def progress(index: int, running: float) -> None:
        print(f"  {form} [{index + 1}]{running:.4f}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    result = chunked_perplexity(loaded.model, tokens, n_ctx, bos, chunks, on_chunk=progress)
    seconds = time.perf_counter() - started
    del loaded, forward
    mx.clear_cache()
    return {"form": form, "weights": weights, "ppl": result.ppl, "error": result.error,
            "text_tokens": result.text_tokens, "bos": bos, "chunks": len(result.chunk_ppl),
            "scored": result.scored, "load_seconds": round(load_seconds, 1),
            "seconds": round(seconds, 1), "running": [round(v, 4) for v in result.running],
            "chunk_ppl": [round(v, 4) for v in result.chunk_ppl]}


def lscpu_lines() -> list[str]:
    """`lscpu | grep -E 'Model name|Flags'`: the CPU and its instruction sets, for the report."""
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [" ".join(line.split()) for line in done.stdout.splitlines()
            if re.match(r"\s*(Model name|Flags)", line)]


def run(args: argparse.Namespace) -> int:
    from rewind.bench.machine import command_line, display_path, user_command
    from rewind.bench.report import Report, Table
    from rewind.bench.servers import (ServerUnavailable, ensure_llama_cpp, llama_cpp_version,
                                      resolve_model_files)

    gguf = args.gguf or resolve_model_files(args.model).gguf
    text = args.text.read_text()
    llama: dict[str, Any] | None = None
    llama_argv: list[str] = []
    if args.llama_cpp:
        if gguf is None:
            raise SystemExit(f"--llama-cpp: no GGUF for {args.model!r} (pass --gguf)")
        try:
            ensure_llama_cpp(args.install_llama_cpp, ("llama-perplexity",))
        except ServerUnavailable as exc:
            raise SystemExit(f"--llama-cpp: {exc}") from None
        llama_argv = llama_perplexity_argv(gguf, args.text, args.ctx, args.chunks)
        print(f"llama.cpp: {user_command(llama_argv)}", file=sys.stderr, flush=True)
        llama = run_llama_perplexity(llama_argv)
        print(f"llama.cpp: PPL = {llama['ppl']:.4f} +/- {llama['error']:.5f}", file=sys.stderr)

    rows = []
    for form in args.forms:
        print(f"Rewind {form}:", file=sys.stderr, flush=True)
        row = measure_form(args.model, form, text, args.ctx, args.chunks)
        if llama is not None:
            row["ratio_to_llama_cpp"] = row["ppl"] / llama["ppl"]
            row["max_running_deviation"] = max(
                (abs(ours / theirs - 1) for ours, theirs in zip(row["running"], llama["running"])
                 if theirs and math.isfinite(theirs)), default=None)
        rows.append(row)
        print(f"Rewind {form}: PPL = {row['ppl']:.4f} +/- {row['error']:.5f}", file=sys.stderr)

    first = rows[0] if rows else None
    headers = ["measured by", "weights", "PPL", "+/-", "vs llama-perplexity", "chunks",
               "tokens scored", "seconds"]
    table_rows = []
    if llama is not None:
        table_rows.append(["llama-perplexity", "GGUF (llama.cpp's kernels)", f"{llama['ppl']:.4f}",
                           f"{llama['error']:.4f}", "1", str(llama["chunks"]),
                           "-", f"{llama['seconds']:.0f}"])
    for row in rows:
        ratio = row.get("ratio_to_llama_cpp")
        table_rows.append([f"Rewind {row['form']}", row["weights"], f"{row['ppl']:.4f}",
                           f"{row['error']:.4f}",
                           "-" if ratio is None else f"{ratio:.4f} ({(ratio - 1) * 100:+.2f}%)",
                           str(row["chunks"]), str(row["scored"]), f"{row['seconds']:.0f}"])
    tables = [Table(f"Perplexity, n_ctx {args.ctx}, {display_path(args.text)}", headers,
                    table_rows, note="PPL and +/- as llama-perplexity prints its final estimate; "
                                     "Rewind's by the same method (second half of each chunk).")]
    series = [("llama-perplexity", llama["running"])] if llama is not None else []
    series += [(f"Rewind {row['form']}", row["running"]) for row in rows]
    if series:
        count = max(len(values) for _, values in series)
        shown = sorted({*range(0, count, 5), count - 1})
        tables.append(Table("Running perplexity after chunk i (llama-perplexity's [i] values)",
                            ["chunk", *(name for name, _ in series)],
                            [[str(i + 1), *(f"{values[i]:.4f}" if i < len(values) else "-"
                                            for _, values in series)] for i in shown]))
    notes = []
    in_place = next((row for row in rows if row["form"] == "in-place"), None)
    if in_place is not None and llama is not None:
        ratio = in_place["ratio_to_llama_cpp"]
        verdict = "within" if abs(ratio - 1) <= TOLERANCE else "OUTSIDE"
        notes.append(f"Rewind in place / llama-perplexity = {ratio:.4f}: {verdict} the issue's "
                     f"{TOLERANCE:.1%}.")
    if llama is not None and first is not None and llama["chunks"] != first["chunks"]:
        notes.append(f"llama-perplexity computed over {llama['chunks']} chunks, Rewind over "
                     f"{first['chunks']}: the tokenizations differ in length.")
    notes += [f"CPU (`lscpu | grep -E 'Model name|Flags'`): {line}" for line in lscpu_lines()]

    servers = {f"Rewind {form}": FORM_NOTES[form] for form in args.forms}
    if llama is not None:
        servers["llama.cpp"] = f"llama-perplexity ({llama_cpp_version() or 'unknown build'})"
    report = Report(
        workload="perplexity", command=command_line(),
        params={"model": args.model, "gguf": display_path(gguf) if gguf else None,
                "text": display_path(args.text), "text_tokens": first and first["text_tokens"],
                "bos": first and first["bos"], "n_ctx": args.ctx, "chunks": args.chunks or "all"},
        servers=servers,
        commands={"llama.cpp": user_command(llama_argv)} if llama_argv else {},
        fairness=["the same GGUF file and the same text file for every row",
                  "llama-perplexity's method on Rewind's side: the text tokenized whole (BOS "
                  "first), chunks of n_ctx tokens each evaluated from scratch with BOS as its "
                  "first token, only the second half of each chunk scored "
                  "(rewind.models.quality.chunked_perplexity)",
                  "perplexity does not depend on time: the machine's load moves only the seconds"],
        records=[*rows, *([{"form": "llama.cpp", **llama}] if llama else [])],
        summary={row["form"]: {"ppl": row["ppl"], "error": row["error"],
                               "ratio_to_llama_cpp": row.get("ratio_to_llama_cpp")}
                 for row in rows} | ({"llama.cpp": {"ppl": llama["ppl"], "error": llama["error"]}}
                                     if llama else {}),
        tables=tables, notes=notes)
    for path in report.write(args.out, args.stem):
        print(path)
    print("\n".join(table.markdown() for table in tables))
    print("\n".join(notes[:2]))
    return 0
