"""Stored forms of the default model (bf16, 8-bit, 4-bit g64/g32): conversion time, size, perplexity, speed.

For each form: convert it (once; cached in the models folder), then measure perplexity on
tests/data/perplexity_paragraph.txt and prefill / decode tokens/s, both computing in the stored
dtype and in float32 (what the loader uses on CPU, where only float32 reaches OpenBLAS). Also the
proof of the Gemma norm fix: perplexity with the norms left as llama.cpp stores them (w + 1).
Writes benchmarks/results/model-forms.md and .json (summarized in convert.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

FORMS = ("bf16", "q8", "q4g32", "q4")
PARAGRAPH = Path(__file__).resolve().parents[3] / "tests" / "data" / "perplexity_paragraph.txt"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--forms", nargs="+", default=list(FORMS), help=f"forms to measure (default {FORMS})")
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--native-forms", nargs="*", default=["bf16"],
                        help="forms also measured in their stored dtype (default bf16; on CPU the "
                             "quantized ones run bf16 activations at ~1 token/s)")
    parser.add_argument("--skip-speed", action="store_true", help="perplexity and size only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def _speed(model, prefill_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) through Rewind's forward seam: logits for the last position only."""
    import mlx.core as mx

    from rewind.cache.kv import make_cache
    from rewind.engine.forward import last_logits

    prompt = mx.array([[2] + [(7 * i) % 5000 + 100 for i in range(prefill_tokens - 1)]])
    warm_cache = make_cache(model)
    mx.eval(last_logits(model, prompt[:, :16], warm_cache))  # first-call setup out of the timing
    cache = make_cache(model)
    started = time.perf_counter()
    logits = last_logits(model, prompt, cache)
    mx.eval(logits)
    prefill_rate = prefill_tokens / (time.perf_counter() - started)
    token = mx.argmax(logits, axis=-1).reshape(1, 1)
    started = time.perf_counter()
    for _ in range(decode_tokens):
        token = mx.argmax(last_logits(model, token, cache), axis=-1).reshape(1, 1)
        mx.eval(token)
    decode_rate = decode_tokens / (time.perf_counter() - started)
    return prefill_rate, decode_rate


def _norms_as_stored(model) -> None:
    """Put back llama.cpp's w + 1 on every Gemma RMSNorm weight: what a converter without the fix
    would produce."""
    from mlx.utils import tree_flatten, tree_unflatten

    shifted = [(name, value + 1.0) for name, value in tree_flatten(model.parameters())
               if name.endswith("norm.weight")]
    model.update(tree_unflatten(shifted))


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm.utils import load

    from rewind.models.conversion import folder_size
    from rewind.models.quality import compute_in_float32, perplexity
    from rewind.models.registry import current_backend, ensure_default

    text = PARAGRAPH.read_text()
    rows = []
    for form in args.forms:
        path = ensure_default(form)
        meta = json.loads((path / "rewind.json").read_text())
        model, tokenizer = load(str(path))
        row = {"form": form, "path": str(path), "convert_seconds": meta["seconds"],
               "size_mb": round(folder_size(path) / 1e6, 1),
               "weights_mb": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6, 1)}
        if form in args.native_forms:
            row["ppl_native"] = round(perplexity(model, tokenizer, text), 3)
            if not args.skip_speed:
                row["prefill_native"], row["decode_native"] = (
                    round(x, 1) for x in _speed(model, args.prefill_tokens, args.decode_tokens))
        compute_in_float32(model)
        row["ppl_f32"] = round(perplexity(model, tokenizer, text), 3)
        if not args.skip_speed:
            from rewind.models.loader import prepare_for_backend

            prepare_for_backend(model)  # what `rewind` serves with: float32 on CPU, plus its fast head
            row["prefill_f32"], row["decode_f32"] = (
                round(x, 1) for x in _speed(model, args.prefill_tokens, args.decode_tokens))
        if form == "bf16":
            model, tokenizer = load(str(path))
            compute_in_float32(model)
            _norms_as_stored(model)
            row["ppl_f32_without_norm_fix"] = round(perplexity(model, tokenizer, text), 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        del model
        mx.clear_cache()

    command = "rewind bench model-forms " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "rewind bench model-forms"
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, backend {current_backend()}, "
               f"load average {os.getloadavg()[0]:.1f} at the end, BLAS preload "
               f"{os.environ.get('LD_PRELOAD', 'none')}")
    n_tokens = len(tokenizer.encode(text))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model-forms.json").write_text(json.dumps({"command": command, "machine": machine,
                                                       "paragraph_tokens": n_tokens, "rows": rows}, indent=2))
    lines = [
        "# Default model forms: conversion, size, perplexity, speed", "",
        f"Command: `{command}`  ", f"Machine: {machine}  ",
        f"Perplexity text: tests/data/perplexity_paragraph.txt ({n_tokens} tokens). Speed: "
        f"{args.prefill_tokens}-token prefill, {args.decode_tokens} decode steps, batch 1, through "
        "`rewind.engine.forward` (last-position logits).", "",
        "| form | convert s | weights MB | ppl (f32 compute) | ppl (stored dtype) | prefill tok/s f32 | "
        "decode tok/s f32 | prefill tok/s stored | decode tok/s stored |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(f"| {row['form']} | {row['convert_seconds']} | {row['weights_mb']} | {row['ppl_f32']} | "
                     f"{row.get('ppl_native', '-')} | {row.get('prefill_f32', '-')} | {row.get('decode_f32', '-')} | "
                     f"{row.get('prefill_native', '-')} | {row.get('decode_native', '-')} |")
    for row in rows:
        if "ppl_f32_without_norm_fix" in row:
            lines += ["", f"Gemma norm fix: bf16 perplexity {row['ppl_f32']} with the fix, "
                          f"{row['ppl_f32_without_norm_fix']} with the norms left as llama.cpp stores them (w + 1)."]
    (args.out / "model-forms.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
