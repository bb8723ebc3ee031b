"""Prefill and decode tokens/s of one model: Rewind's path vs plain mlx-lm, side by side.

Rewind: rewind.models.loader.load_model (float32 on CPU, decode through the CPU kernels with bf16
layers and a bf16/int8 head) and
rewind.engine.single.generate_tokens (chunked prefill, logits for the last position only).
mlx-lm: mlx_lm.load + mlx_lm.generate.stream_generate on the same folder, as stored, and (with
`--mlx-lm-float32`) with its weights cast to float32, the fastest plain-mlx-lm form on a CPU.
Results: benchmarks/results/speed.{json,md} (speed-no-openblas.* when OpenBLAS is not loaded).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

from rewind.bench.machine import display_path

RESULTS = Path("benchmarks/results")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="registry name or model folder")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=0, metavar="TOKENS",
                        help="tokens already in the cache before the prompt (an agent's next turn: "
                             "prefill of new tokens after a long conversation), not timed")
    parser.add_argument("--json", type=Path, default=None,
                        help="JSON output (Markdown beside it); default benchmarks/results/"
                             "speed.json, or speed-no-openblas.json without OpenBLAS")
    parser.add_argument("--skip-mlx-lm", action="store_true", help="measure Rewind's path only")
    parser.add_argument("--mlx-lm-float32", action="store_true",
                        help="also measure mlx-lm with its weights cast to float32")
    parser.add_argument("--cpu-head", default=None, choices=["auto", "bf16", "int8", "off"],
                        help="Rewind's CPU decode head (default: the loader's, REWIND_CPU_HEAD)")
    parser.add_argument("--also-int8-head", action="store_true",
                        help="also measure Rewind with the int8 CPU decode head")
    parser.add_argument("--also-int8", action="store_true",
                        help="also measure Rewind with int8 layers and head (REWIND_NATIVE=int8, "
                             "REWIND_CPU_HEAD=int8)")
    parser.add_argument("--native", default=None,
                        choices=["auto", "bf16", "f32", "int8", "off"],
                        help="Rewind's CPU kernels for the layers (default: the loader's, "
                             "REWIND_NATIVE)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also measure llama.cpp (llama-bench, built by "
                             "scripts/install-llama-cpp.sh) on the GGUF the model came from")
    parser.add_argument("--also-exact", action="store_true",
                        help="also measure Rewind with the model folder's weights (bf16 for the "
                             "default) where the default reads the GGUF's blocks in place")
    parser.add_argument("--also-mlx-layers", action="store_true",
                        help="also measure Rewind with the layers in MLX (C kernels off)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over every row (each row loads and runs again per round); "
                             "the report gives medians and min-max: memory bandwidth on a shared "
                             "machine moves decode by 20%% from minute to minute")
    parser.add_argument("--json-schema", default=None, metavar="FILE|array",
                        help="also measure decode through the engine with this JSON schema "
                             "enforced (llguidance's mask each step) and without, side by side; "
                             "'array' is an array of integers, which never has to close")
    parser.add_argument("--perplexity", type=Path, default=None, metavar="TEXT_FILE",
                        help="also give each Rewind row's perplexity on this text (its layers and "
                             "head, e.g. exact vs int8), up to 2,048 tokens")


def prompt_tokens(count: int, vocab_size: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt (speed does not depend on which tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(3, min(vocab_size, 32000), size=count).tolist()


def measure_rewind(model_name: str, tokens: list[int], gen_tokens: int,
                   cpu_head: str | None, native_form: str | None = None,
                   context: list[int] | None = None,
                   perplexity_text: str | None = None,
                   in_place: bool | None = None) -> dict[str, Any]:
    import mlx.core as mx

    from rewind.cache.kv import make_cache
    from rewind.kernels.fast_head import fast_head
    from rewind.kernels.native_forward import native_forward
    from rewind.engine.single import generate_tokens
    from rewind.models.loader import load_model

    loaded = load_model(model_name, cpu_head=cpu_head, native_forward=native_form,
                        in_place=in_place)
    model = loaded.model
    for _ in generate_tokens(model, tokens[:64], max_tokens=4):  # warm-up: kernels, allocator
        pass
    cache = make_cache(model)
    if context:  # one sampled token, no decode step: the cache holds exactly the context
        for _ in generate_tokens(model, context, cache=cache, max_tokens=1):
            pass
    start, cpu_start = time.perf_counter(), time.process_time()
    stream = generate_tokens(model, tokens, cache=cache, max_tokens=gen_tokens)
    next(stream)
    first, cpu_first = time.perf_counter(), time.process_time()
    produced = 1 + sum(1 for _ in stream)
    end, cpu_end = time.perf_counter(), time.process_time()
    head = fast_head(model)
    forward = native_forward(model)
    variant = [f"{cpu_head} head"] if cpu_head not in (None, "auto") else []
    variant += [f"{native_form} layers"] if native_form not in (None, "auto") else []
    variant += ["folder weights"] if in_place is False else []
    result = {
        "path": "rewind" + (f" ({', '.join(variant)})" if variant else ""),
        "prefill_tps": len(tokens) / (first - start),
        "decode_tps": (produced - 1) / (end - first) if produced > 1 else None,
        "generated": produced,
        "prefill_cpu_s": cpu_first - cpu_start,
        "decode_cpu_s": cpu_end - cpu_first,
        "compute_dtype": ("float32 in C kernels" if forward is not None
                          else str(next(iter(_float_dtypes(model)), ""))),
        "decode_head": head.form if head is not None else "mlx",
        "decode_layers": forward.form if forward is not None else "mlx",
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "model_path": display_path(loaded.path),
    }
    if perplexity_text is not None:
        result["perplexity"] = rewind_perplexity(model, loaded.tokenizer, perplexity_text)
    del loaded, model
    return result


def rewind_perplexity(model: Any, tokenizer: Any, text: str, limit: int = 2048) -> float:
    """Perplexity of `text` (its first `limit` tokens) through Rewind's own path: the backbone as
    loaded (C kernels or MLX layers, in the row's form) and its CPU head if one is installed."""
    import math

    import mlx.core as mx
    import numpy as np

    from rewind.kernels.fast_head import fast_head
    from rewind.kernels.model_split import split_model

    tokens = tokenizer.encode(text)[:limit]
    split = split_model(model)
    hidden = split.backbone(mx.array([tokens[:-1]]), cache=None)[0]
    logits = split.logits(hidden, fast_head(model)).astype(mx.float32)
    log_probs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    targets = np.array(tokens[1:])
    return math.exp(-float(log_probs[np.arange(len(targets)), targets].mean()))


def _float_dtypes(model: Any) -> set[Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def measure_mlx_lm(path: Path, tokens: list[int], gen_tokens: int, float32: bool,
                   context: list[int] | None = None) -> dict[str, Any]:
    # mlx-lm as shipped: Rewind's kernels reach only the models Rewind's loader set up
    # (rewind.kernels.rebind routes per module instance); any other model calls mlx-lm's.
    return _measure_mlx_lm(path, tokens, gen_tokens, float32, context)


def _measure_mlx_lm(path: Path, tokens: list[int], gen_tokens: int, float32: bool,
                    context: list[int] | None = None) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step, stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(path))
    if float32:
        model.set_dtype(mx.float32)
    stored = sorted(str(d) for d in _float_dtypes(model))
    for _ in stream_generate(model, tokenizer, tokens[:64], max_tokens=4):  # warm-up
        pass
    cache = make_prompt_cache(model)
    if context:  # mlx-lm's own prefill; max_tokens=0 leaves the cache holding the context
        for _ in generate_step(mx.array(context), model, max_tokens=0, prompt_cache=cache):
            pass
        mx.eval([c.state for c in cache])
    last = None
    cpu_start = time.process_time()
    cpu_first = None
    for last in stream_generate(model, tokenizer, tokens, max_tokens=gen_tokens,
                                prompt_cache=cache):
        if cpu_first is None:
            cpu_first = time.process_time()
    cpu_end = time.process_time()
    assert last is not None and cpu_first is not None
    result = {
        "path": "mlx-lm float32" if float32 else "mlx-lm as stored",
        "prefill_tps": last.prompt_tps,
        "decode_tps": last.generation_tps,
        "generated": last.generation_tokens,
        "prefill_cpu_s": cpu_first - cpu_start,
        "decode_cpu_s": cpu_end - cpu_first,
        "compute_dtype": ",".join(stored),
        "decode_head": "mlx",
        "decode_layers": "mlx",
        "peak_memory_gb": last.peak_memory,
        "model_path": display_path(path),
    }
    del model, tokenizer
    return result


def llama_bench_argv(gguf: Path, prompt: int, gen: int, depth: int, threads: int) -> list[str]:
    """llama-bench for one test: `-p N -n 0` times a prefill of N tokens, `-p 0 -n N` a decode of
    N tokens, each after `depth` tokens already in its KV cache (-d; filled untimed, once, and
    restored for each of its repetitions). Its defaults otherwise: 5 repetitions, a warm-up run."""
    from rewind.bench.servers import llama_cpp_binary

    return [str(llama_cpp_binary("llama-bench")), "-m", str(gguf), "-p", str(prompt),
            "-n", str(gen), "-d", str(depth), "-t", str(threads), "-o", "json"]


def run_llama_bench(argv: list[str]) -> dict[str, Any]:
    """The one test's JSON object that llama-bench prints (avg_ts, samples_ts, build_commit...)."""
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-2000:]}")
    tests = json.loads(done.stdout)
    if len(tests) != 1:
        raise RuntimeError(f"llama-bench printed {len(tests)} tests, expected one")
    return tests[0]


def measure_llama_cpp(model_name: str, prompt_count: int, gen_tokens: int,
                      context: int = 0) -> dict[str, Any]:
    """llama.cpp's row from llama-bench (built by scripts/install-llama-cpp.sh), measured as the
    Rewind rows are: prefill of `prompt_count` new tokens after `context` cached ones, then
    decode of `gen_tokens` after context + prompt. llama-bench times one phase per test, so it
    runs twice: a prefill test at depth `context`, a decode test at depth `context + prompt`."""
    from rewind.bench.machine import user_command
    from rewind.bench.servers import llama_cpp_installed, resolve_model_files

    gguf = resolve_model_files(model_name).gguf
    if gguf is None or not llama_cpp_installed():
        raise SystemExit("--llama-cpp needs the model's GGUF and llama-bench "
                         "(bash scripts/install-llama-cpp.sh)")
    threads = os.cpu_count() or 1
    prefill_argv = llama_bench_argv(gguf, prompt_count, 0, context, threads)
    decode_argv = llama_bench_argv(gguf, 0, gen_tokens, context + prompt_count, threads)
    cpu_start = _children_cpu()
    prefill = run_llama_bench(prefill_argv)
    decode = run_llama_bench(decode_argv)
    return {
        "path": "llama.cpp (llama-bench)",
        "prefill_tps": prefill["avg_ts"],
        "decode_tps": decode["avg_ts"],
        "generated": gen_tokens,
        "prefill_cpu_s": None,  # llama-bench repeats each test: only the processes' total is known
        "decode_cpu_s": None,
        "total_cpu_s": _children_cpu() - cpu_start,
        "compute_dtype": "GGUF Q4_K_M (its own kernels)",
        "decode_head": "gguf",
        "decode_layers": "gguf",
        "peak_memory_gb": None,
        "model_path": display_path(gguf),
        "commands": [user_command(prefill_argv), user_command(decode_argv)],
        "llama_bench": {"prefill_samples_ts": prefill.get("samples_ts"),
                        "decode_samples_ts": decode.get("samples_ts"),
                        "build_commit": prefill.get("build_commit"),
                        "build_number": prefill.get("build_number"),
                        "n_threads": prefill.get("n_threads"), "cpu_info": prefill.get("cpu_info")},
    }


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def markdown(report: dict[str, Any]) -> str:
    from rewind.bench.machine import machine_markdown

    lines = [
        f"# Speed: {report['model']} ({report['blas']})",
        "",
        f"Prompt {report['prompt_tokens']} tokens, {report['gen_tokens']} generated, one sequence"
        + (f", after {report['context_tokens']} tokens already in the cache (untimed)."
           if report.get("context_tokens") else "."),
        "",
        f"Command: `{report['command']}`",
        "",
        "Wall-clock tokens/s (median of the rounds, min-max; rows run in turn within each round), "
        "and process CPU seconds per phase (all threads) of the median run: on a shared machine "
        "the CPU seconds say how much work each path does, whatever else is running.",
        "",
        "| path | prefill tok/s | decode tok/s | prefill CPU s | decode CPU s | compute dtype "
        "| decode layers | decode head | peak GB |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['path']} | {_spread(row, 'prefill_tps')} | "
                     f"{_spread(row, 'decode_tps')} | "
                     f"{_number(row['prefill_cpu_s'], 1)} | {_number(row['decode_cpu_s'], 1)} | "
                     f"{row['compute_dtype']} | {row.get('decode_layers', 'mlx')} | "
                     f"{row['decode_head']} | {_number(row['peak_memory_gb'], 2)} |")
    with_perplexity = [row for row in report["rows"] if "perplexity" in row]
    if with_perplexity:
        lines += ["", f"Perplexity on `{report['perplexity_text']}` (first 2,048 tokens), by row: "
                  + ", ".join(f"{row['path']} {row['perplexity']:.3f}" for row in with_perplexity)]
    for row in report["rows"]:
        if row.get("commands"):
            lines += ["", f"{row['path']}: {report.get('llama_cpp_version') or ''}; prefill, then "
                      "decode, as llama-bench's mean over its repetitions (the rounds' median "
                      "above), each after the same tokens already cached as Rewind's rows:", ""]
            lines += [f"    {command}" for command in row["commands"]]
    lines += ["", "## Machine", "", machine_markdown(report["machine"]), ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from rewind import blas
    from rewind.bench.machine import command_line, machine_info
    from rewind.models.loader import resolve

    path = resolve(args.model)
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 32000)
    tokens = prompt_tokens(args.prompt_tokens, vocab)
    context = prompt_tokens(args.context, vocab, seed=1) if args.context else None
    print(blas.status())
    perplexity_text = args.perplexity.read_text() if args.perplexity is not None else None
    measures = []  # one callable per row, run once per round
    variants: list[tuple[str | None, str | None, bool | None]] = [
        (args.cpu_head, args.native, None)]
    if args.also_exact:
        variants.append((args.cpu_head, args.native, False))
    if args.also_int8_head:
        variants.append(("int8", args.native, None))
    if args.also_int8:
        variants.append(("int8", "int8", None))
    if args.also_mlx_layers:
        variants.append((args.cpu_head, "off", None))
    for cpu_head, native_form, in_place in variants:
        measures.append(lambda h=cpu_head, n=native_form, i=in_place: measure_rewind(
            args.model, tokens, args.gen_tokens, h, n, context, perplexity_text, i))
    forms = [] if args.skip_mlx_lm else [False] + ([True] if args.mlx_lm_float32 else [])
    for float32 in forms:
        measures.append(lambda f=float32: measure_mlx_lm(path, tokens, args.gen_tokens, f, context))
    if args.json_schema is not None:
        from rewind.bench.constrained_speed import load_schema, measure_engine_decode

        schema = load_schema(args.json_schema)
        for constrained in (None, schema):
            measures.append(lambda c=constrained: measure_engine_decode(
                args.model, tokens, args.gen_tokens, c))
    if args.llama_cpp:
        measures.append(lambda: measure_llama_cpp(args.model, args.prompt_tokens, args.gen_tokens,
                                                  args.context))
    runs: list[list[dict[str, Any]]] = [[] for _ in measures]
    for round_index in range(max(1, args.repeats)):
        for index, measure in enumerate(measures):
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
            runs[index].append(measure())
            _print_row(runs[index][-1], f"[{round_index + 1}/{max(1, args.repeats)}] ")
    rows = [_median_row(row_runs) for row_runs in runs]
    openblas = blas.openblas_active()
    out = args.json or RESULTS / ("speed.json" if openblas else "speed-no-openblas.json")
    report = {
        "command": command_line(),
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "context_tokens": args.context,
        "repeats": max(1, args.repeats),
        "blas": "OpenBLAS" if openblas else "no OpenBLAS (MLX reference BLAS)",
        "rows": rows,
        "machine": machine_info(),
    }
    if args.llama_cpp:
        from rewind.bench.servers import llama_cpp_version

        report["llama_cpp_version"] = llama_cpp_version()
    if args.perplexity is not None:
        report["perplexity_text"] = str(args.perplexity)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The row of the median decode run, with every run's prefill and decode tokens/s and the
    medians of both."""
    import statistics

    ordered = sorted(runs, key=lambda run: run["decode_tps"] or 0.0)
    row = dict(ordered[(len(ordered) - 1) // 2])
    for key in ("prefill_tps", "decode_tps"):
        values = [run[key] for run in runs if run[key] is not None]
        row[f"{key}_runs"] = values
        row[key] = statistics.median(values) if values else None
    return row


def _spread(row: dict[str, Any], key: str) -> str:
    value = row[key]
    if value is None:
        return "n/a"
    runs = row.get(f"{key}_runs") or []
    if len(runs) < 2:
        return f"{value:.1f}"
    return f"{value:.1f} ({min(runs):.1f}-{max(runs):.1f})"


def _number(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _print_row(row: dict[str, Any], prefix: str = "") -> None:
    decode = f"{row['decode_tps']:7.1f}" if row["decode_tps"] else "    n/a"
    print(f"{prefix}{row['path']:<18} prefill {row['prefill_tps']:7.1f} tok/s   decode {decode} tok/s   "
          f"({row['compute_dtype']}, layers {row.get('decode_layers', 'mlx')}, "
          f"head {row['decode_head']})", flush=True)
