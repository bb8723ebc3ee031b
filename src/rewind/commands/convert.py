"""`rewind convert SRC [--q-bits 4|8|16] [--q-group-size 64] [--out DIR]`: a GGUF file (llama, qwen2,
qwen3, gemma3) or a Hugging Face safetensors folder -> an mlx-lm model folder."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a GGUF file or a Hugging Face folder into an MLX model folder",
        description=__doc__)
    parser.add_argument("src", help="a .gguf file, a Hugging Face model folder, or 'default'")
    parser.add_argument("--q-bits", type=int, choices=(4, 8, 16), default=16,
                        help="16 keeps bfloat16; 4 or 8 quantizes with mlx-lm (default 16)")
    parser.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=64,
                        help="quantization group size (default 64)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: the models folder in the cache, named after SRC and form)")
    parser.set_defaults(func=run)


def default_out(src: str, form: str) -> Path:
    from rewind import paths

    stem = Path(src.rstrip("/")).name
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    return paths.models_dir() / f"{stem}-{form}"


def run(args: argparse.Namespace) -> int:
    from rewind.forms import QuantSpec
    from rewind.models.conversion import convert, folder_size, is_model_folder
    from rewind.models.gguf_file import GgufError

    try:
        spec = QuantSpec(args.q_bits, args.q_group_size)
    except ValueError as exc:
        print(f"rewind convert: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        if args.src == "default" and args.out is None:
            from rewind.models.registry import ensure_default

            out = ensure_default(spec.form)
        else:
            src = args.src
            if src == "default":
                from rewind.models.registry import default_gguf

                src = str(default_gguf())
            out = args.out.expanduser() if args.out else default_out(src, spec.form)
            if is_model_folder(out):
                print(f"{out} already holds a model; nothing to do (remove it to convert again)", file=sys.stderr)
                return 0
            out = convert(Path(src), out, spec)
    except (GgufError, FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"rewind convert: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - started
    print(f"{out}  ({spec.form}, {folder_size(out) / 1e6:.0f} MB, {seconds:.1f} s)")
    return 0
