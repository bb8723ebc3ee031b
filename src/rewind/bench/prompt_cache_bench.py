"""prompt-cache: an agent session with reasoning dropped each turn, with Rewind's prompt cache and
without; restore speed from disk against prefill speed; RSS over many conversations with the disk
tier and with every record kept in RAM. In-process on Gemma 3 270M (no server, no HTTP).

Each turn's prompt is the previous prompt plus the assistant's answer (its reasoning dropped by
the client, as agents do) and a tool result. Prefill goes through rewind.engine.single.prefill_with_cache:
chunks end on 256-token boundaries, at the end of the last message and at len - 1, with a
checkpoint at each; time to first token is restore + prefill + the last position's logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rewind.bench.report import Plot, Report, Table
from rewind.bench.machine import command_line
from rewind.bench.textgen import AgenticText, agent_messages

NAME = "prompt-cache"
MIB = 1 << 20


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--tool-tokens", type=int, default=700, help="new content per turn")
    parser.add_argument("--baseline-turns", default="all",
                        help="turns also run without the cache: 'all' or e.g. '1,5,10'")
    parser.add_argument("--conversations", type=int, default=20, help="for the RSS part")
    parser.add_argument("--conversation-tokens", type=int, default=512)
    parser.add_argument("--hot-ram", default="64MiB",
                        help="RAM tier next to the disk tier in the RSS part")
    parser.add_argument("--folder", type=Path, default=None, help="scratch folder (default: temp)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true",
                        help="4 turns of ~2k tokens, 5 conversations of 512 tokens (smoke run)")


def _chat_tokens(tokenizer: Any, messages: list[dict]) -> tuple[list[int], int]:
    """Prompt tokens with the generation prompt, and where the last message ends (the point the
    next turn diverges from, sent as a checkpoint)."""
    tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    without = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    boundary = len(without) if tokens[: len(without)] == without else 0
    return tokens, boundary


def session_prompts(tokenizer: Any, turns: int, system_tokens: int, tool_tokens: int,
                    seed: int = 7) -> list[tuple[list[int], int]]:
    text = AgenticText(seed)
    system, task = text.system_prompt(system_tokens), text.user_task(60)
    steps = [text.turn(answer_tokens=80, tool_tokens=tool_tokens) for _ in range(turns - 1)]
    return [_chat_tokens(tokenizer, agent_messages(system, task, steps[:t])) for t in range(turns)]


def _timed_prefill(model: Any, tokens: list[int], boundary: int, cache: Any) -> tuple[float, Any]:
    from rewind.engine.single import prefill_with_cache

    started = time.perf_counter()
    result = prefill_with_cache(model, tokens, cache, checkpoints=[boundary] if boundary else [])
    return time.perf_counter() - started, result


def run_session(args: argparse.Namespace, loaded: Any, folder: Path) -> dict[str, Any]:
    import mlx.core as mx

    from rewind.cache import PromptCache
    from rewind.config import CacheConfig

    prompts = session_prompts(loaded.tokenizer, args.turns, args.system_tokens, args.tool_tokens)
    if args.baseline_turns == "all":
        baseline_turns = set(range(1, args.turns + 1))
    else:
        baseline_turns = {int(t) for t in args.baseline_turns.split(",") if t.strip()}
    cache = PromptCache(loaded.model, loaded.fingerprint,
                        CacheConfig(cache_dir=folder, disk_bytes=8 << 30))
    turns: list[dict[str, Any]] = []
    previous: list[int] = []
    for number, (tokens, boundary) in enumerate(prompts, start=1):
        shared = 0
        while shared < min(len(tokens), len(previous)) and tokens[shared] == previous[shared]:
            shared += 1
        seconds, result = _timed_prefill(loaded.model, tokens, boundary, cache)
        restored = result.restored
        row = {
            "turn": number, "prompt_tokens": len(tokens), "new_tokens": len(tokens) - shared,
            "cached_tokens": restored.tokens, "recomputed_tokens": len(tokens) - restored.tokens,
            "ram_tokens": restored.ram_tokens, "disk_tokens": restored.disk_tokens,
            "restore_seconds": restored.seconds, "ttft_cached_s": seconds,
            "ttft_uncached_s": None, "first_token_matches": None,
        }
        if number in baseline_turns:
            cold_seconds, cold = _timed_prefill(loaded.model, tokens, boundary, None)
            row["ttft_uncached_s"] = cold_seconds
            row["first_token_matches"] = bool(
                mx.argmax(cold.logits).item() == mx.argmax(result.logits).item())
            row["max_logit_difference"] = float(mx.abs(cold.logits - result.logits).max())
            del cold
        print(f"turn {number}: {len(tokens)} tokens, recomputed {row['recomputed_tokens']}, "
              f"ttft {seconds:.2f}s cached / {row['ttft_uncached_s'] or float('nan'):.2f}s cold",
              flush=True)
        turns.append(row)
        previous = tokens
        del result
        gc.collect()

    # Restore speed from disk: the whole last prompt, every record read from the scratch file.
    tokens, _ = prompts[-1]
    cache.ram.set_budget(0)
    cache.flush()
    disk: dict[str, Any] = {}
    for label in ("cold", "warm"):
        dropped = cache.store.drop_page_cache() if label == "cold" else False
        restored = cache.restore(tokens)
        disk[label] = {"tokens": restored.tokens, "seconds": restored.seconds,
                       "tokens_per_second": restored.tokens / restored.seconds,
                       "from_disk_tokens": restored.disk_tokens, "page_cache_dropped": dropped}
        del restored
    stats = cache.stats()
    cache.close()
    return {"turns": turns, "disk_restore": disk, "cache_stats": stats}


def rss_worker(mode: str, model_name: str, conversations: int, tokens_each: int,
               hot_ram: str, folder: str) -> None:
    """One process, one mode: RSS after each of `conversations` different prompts. Printed as
    JSON on the last line (a fresh process per mode, so one mode's memory never counts in the
    other's)."""
    import psutil

    from rewind.cache import PromptCache
    from rewind.config import CacheConfig, parse_size
    from rewind.models.loader import load_model

    loaded = load_model(model_name)
    if mode == "disk":
        config = CacheConfig(ram_bytes=parse_size(hot_ram), cache_dir=Path(folder),
                             disk_bytes=16 << 30)
    else:
        config = CacheConfig(ram_bytes=1 << 40, disk_enabled=False)
    cache = PromptCache(loaded.model, loaded.fingerprint, config)
    process = psutil.Process()
    rss = [process.memory_info().rss]
    for index in range(conversations):
        text = AgenticText(1000 + index).long_document(tokens_each)
        prompt = list(loaded.tokenizer.encode(text))[:tokens_each]
        _timed_prefill(loaded.model, prompt, 0, cache)
        gc.collect()
        rss.append(process.memory_info().rss)
    stats = cache.stats()
    cache.flush()
    disk = cache.store.stats() if cache.store is not None else None
    print(json.dumps({"mode": mode, "rss": rss, "ram_bytes": stats["ram"]["bytes"],
                      "disk_bytes": disk["bytes"] if disk else 0}))
    cache.close()


def run_rss(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    results = {}
    for mode in ("disk", "ram"):
        code = ("from rewind.bench.prompt_cache_bench import rss_worker; "
                f"rss_worker({mode!r}, {args.model!r}, {args.conversations}, "
                f"{args.conversation_tokens}, {args.hot_ram!r}, {str(folder)!r})")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=3600, check=False)
        if done.returncode != 0:
            raise SystemExit(f"RSS worker ({mode}) failed:\n{done.stderr[-3000:]}")
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"rss {mode}: {[round(r / MIB) for r in results[mode]['rss']]} MiB", flush=True)
    return results


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def run(args: argparse.Namespace) -> int:
    from rewind.models.loader import load_model

    if args.quick:
        args.turns, args.system_tokens, args.tool_tokens = 4, 600, 400
        args.conversations, args.conversation_tokens = 5, 512
    loaded = load_model(args.model)
    with tempfile.TemporaryDirectory(dir=args.folder) as scratch:
        session = run_session(args, loaded, Path(scratch))
        del loaded
        gc.collect()
        rss = run_rss(args, Path(scratch))
    turns = session["turns"]
    last = turns[-1]
    measured = [t for t in turns if t["ttft_uncached_s"] is not None]
    final_speedup = (last["ttft_uncached_s"] / last["ttft_cached_s"]
                     if last["ttft_uncached_s"] else None)
    biggest = max(measured, key=lambda t: t["prompt_tokens"]) if measured else None
    prefill_tps = biggest["prompt_tokens"] / biggest["ttft_uncached_s"] if biggest else None
    disk_tps = session["disk_restore"]["cold"]["tokens_per_second"]
    extra = {mode: [(r - data["rss"][0]) / MIB for r in data["rss"]] for mode, data in rss.items()}
    summary = {
        "final_prompt_tokens": last["prompt_tokens"],
        "recompute_beyond_new_content_max": max(
            t["recomputed_tokens"] - t["new_tokens"] for t in turns[1:]) if len(turns) > 1 else None,
        "ttft_speedup_last_turn": final_speedup,
        "prefill_tokens_per_second": prefill_tps,
        "disk_restore_tokens_per_second_cold": disk_tps,
        "disk_restore_tokens_per_second_warm": session["disk_restore"]["warm"]["tokens_per_second"],
        "restore_vs_prefill": disk_tps / prefill_tps if prefill_tps else None,
        "first_tokens_all_match": all(t["first_token_matches"] for t in measured),
        "max_logit_difference": max((t["max_logit_difference"] for t in measured), default=None),
        "extra_rss_mib_disk_tier": extra["disk"][-1],
        "extra_rss_mib_all_in_ram": extra["ram"][-1],
    }
    report = Report(
        workload=NAME,
        command=command_line(),
        params={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("func",)},
        servers={"rewind (in process)": f"{args.model}: PromptCache + mlx-lm model calls"},
        fairness=["The same chunking with and without the cache (256-token boundaries, the last "
                  "message's end, len - 1): the runs differ only by the restore.",
                  "Time to first token = restore + prefill of the rest + the last logits, "
                  "evaluated; no sampling, no HTTP."],
        summary=summary,
    )
    report.records = [{"part": "turn", **t} for t in turns]
    report.records.append({"part": "disk_restore", **session["disk_restore"]})
    report.records += [{"part": "rss", "mode": m, "rss_bytes": d["rss"], "ram_tier_bytes":
                        d["ram_bytes"], "disk_tier_bytes": d["disk_bytes"]} for m, d in rss.items()]
    report.records.append({"part": "cache_stats", **session["cache_stats"]})
    report.tables.append(Table(
        "Agent session, reasoning dropped each turn",
        ["turn", "prompt tokens", "new tokens", "restored (RAM / disk)", "recomputed",
         "TTFT cached (s)", "TTFT no cache (s)", "speed-up", "same first token"],
        [[t["turn"], t["prompt_tokens"], t["new_tokens"],
          f"{t['cached_tokens']} ({t['ram_tokens']} / {t['disk_tokens']})",
          t["recomputed_tokens"], _fmt(t["ttft_cached_s"]), _fmt(t["ttft_uncached_s"]),
          _fmt(t["ttft_uncached_s"] / t["ttft_cached_s"] if t["ttft_uncached_s"] else None, 1),
          t["first_token_matches"]] for t in turns],
        note="new tokens = what this prompt adds to the previous one; recomputed = prompt "
             "tokens not restored (at least 1: the last token's logits are computed)."))
    cold, warm = session["disk_restore"]["cold"], session["disk_restore"]["warm"]
    report.tables.append(Table(
        "Restore from disk vs prefill",
        ["what", "tokens", "seconds", "tokens/s"],
        [["restore from the scratch file, page cache dropped" if cold["page_cache_dropped"]
          else "restore from the scratch file (page cache not dropped)",
          cold["tokens"], _fmt(cold["seconds"], 3), _fmt(cold["tokens_per_second"], 0)],
         ["restore from the scratch file, warm", warm["tokens"], _fmt(warm["seconds"], 3),
          _fmt(warm["tokens_per_second"], 0)],
         ["prefill without cache", biggest["prompt_tokens"] if biggest else "n/a",
          _fmt(biggest["ttft_uncached_s"] if biggest else None),
          _fmt(prefill_tps, 0)]]))
    report.tables.append(Table(
        f"Process RSS over {args.conversations} conversations of {args.conversation_tokens} tokens",
        ["after conversation", "disk tier (+MiB)", "all in RAM (+MiB)"],
        [[i, f"{extra['disk'][i]:.0f}", f"{extra['ram'][i]:.0f}"] for i in range(len(extra["disk"]))],
        note=f"Disk tier: RAM hot tier {args.hot_ram} + scratch file; all in RAM: no disk tier, "
             "unbounded RAM tier. Extra RSS over the process after loading the model."))
    xs = [t["turn"] for t in turns]
    report.plots.append(Plot(
        "ttft.png", "Time to first token per turn (Gemma 3 270M, CPU)", "turn", "seconds",
        {"with prompt cache": (xs, [t["ttft_cached_s"] for t in turns]),
         "without": ([t["turn"] for t in measured], [t["ttft_uncached_s"] for t in measured])}))
    report.plots.append(Plot(
        "rss.png", "Extra process RSS over conversations", "conversations", "MiB",
        {"disk tier": (list(range(len(extra["disk"]))), extra["disk"]),
         "all in RAM": (list(range(len(extra["ram"]))), extra["ram"])}))
    report.notes.append("Records are float32 (the loader computes in float32 on CPU): per 256 "
                        "tokens a K/V delta of the 3 global layers (1.5 MiB) and, at each "
                        "checkpoint, the 512-row window of the 15 sliding layers (15 MiB).")
    report.notes.append("Time to first token moves with the machine's load (load_average under "
                        "Machine): both columns of a turn ran back to back under the same load.")
    stem = "prompt_cache_quick" if args.quick else "prompt_cache"
    for path in report.write(args.out, stem):
        print(path)
    print(json.dumps(summary, indent=1))
    return 0
