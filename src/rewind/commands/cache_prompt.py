"""`rewind cache-prompt`: prefill a prompt once and save the cache to a file.

`rewind generate --prompt-cache-file FILE --prompt MORE` then starts from it: the same answer as
generating from the cached text followed by MORE, without recomputing the cached part. The file
is mlx-lm's prompt-cache format (safetensors) with metadata that ties it to one model: the
model's fingerprint (config + weights), the token ids and text it holds, and the cache's shape
options. A cache from another model is refused, never silently used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewind.commands.common import (
    UserError,
    add_cache_shape_args,
    add_model_arg,
    encode_prefix,
    fail,
    load_or_explain,
    new_cache,
    prefill,
)

FORMAT = "rewind-prompt-cache/1"


@dataclass
class SavedPrompt:
    """What a cache file says about itself (its metadata)."""

    model: str
    fingerprint: str
    tokens: list[int]
    text: str
    chat: bool
    max_kv_size: int | None
    kv_bits: int | None
    kv_group_size: int

    def check_shape(self, max_kv_size: int | None, kv_bits: int | None) -> None:
        """Options given to generate must not contradict the ones the cache was built with."""
        if max_kv_size is not None and max_kv_size != self.max_kv_size:
            raise UserError(f"--max-kv-size {max_kv_size} differs from the cache file's "
                            f"({self.max_kv_size}); leave it out to use the file's")
        if kv_bits is not None and kv_bits != self.kv_bits:
            raise UserError(f"--kv-bits {kv_bits} differs from the cache file's "
                            f"({self.kv_bits}); leave it out to use the file's")

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "tokens": json.dumps(self.tokens),
            "text": self.text,
            "chat": json.dumps(self.chat),
            "max_kv_size": json.dumps(self.max_kv_size),
            "kv_bits": json.dumps(self.kv_bits),
            "kv_group_size": json.dumps(self.kv_group_size),
        }

    @classmethod
    def from_metadata(cls, path: str, metadata: dict[str, str]) -> SavedPrompt:
        if metadata.get("format") != FORMAT:
            raise UserError(f"{path} is not a rewind prompt cache (make one with "
                            f"`rewind cache-prompt`)")
        return cls(
            model=metadata["model"],
            fingerprint=metadata["fingerprint"],
            tokens=json.loads(metadata["tokens"]),
            text=metadata["text"],
            chat=json.loads(metadata["chat"]),
            max_kv_size=json.loads(metadata["max_kv_size"]),
            kv_bits=json.loads(metadata["kv_bits"]),
            kv_group_size=json.loads(metadata["kv_group_size"]),
        )


def _load(path: str) -> tuple[list[Any], dict[str, str]]:
    """mlx-lm's load_prompt_cache, but for any file name: mx.load picks the format by the
    extension, and a cache file may be named anything."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from rewind.cache.kv import from_saved

    if not Path(path).is_file():
        raise UserError(f"no prompt cache file at {path}")
    try:
        arrays, flat_metadata = mx.load(path, format="safetensors", return_metadata=True)
        metadata, classes, scalars = tree_unflatten(list(flat_metadata.items()))
        for position, kind in scalars[1:]:
            value = arrays[position]
            arrays[position] = {"scalar": lambda: value.item(),
                                "string": lambda: "".join(chr(c) for c in value.tolist()),
                                "none": lambda: None}[kind]()
        states = tree_unflatten(list(arrays.items()))
        cache = [from_saved(name, state) for name, state in zip(classes, states)]
    except Exception as exc:  # mlx raises RuntimeError / ValueError on a foreign or torn file
        raise UserError(f"{path} is not a readable prompt cache: {exc}") from exc
    return cache, metadata


def read_cache_metadata(path: str) -> SavedPrompt:
    """The file's metadata from its safetensors header alone: no tensor is read."""
    from mlx.utils import tree_unflatten

    try:
        with open(path, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            if not 0 < header_size < 1 << 30:
                raise ValueError("no safetensors header")
            header = json.loads(handle.read(header_size))
        metadata = tree_unflatten(list(header["__metadata__"].items()))[0]
    except FileNotFoundError as exc:
        raise UserError(f"no prompt cache file at {path}") from exc
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"{path} is not a readable prompt cache: {exc}") from exc
    if not isinstance(metadata, dict):
        raise UserError(f"{path} is not a rewind prompt cache (make one with `rewind cache-prompt`)")
    return SavedPrompt.from_metadata(path, metadata)


def load_cache_file(path: str, fingerprint: str) -> tuple[list[Any], list[int]]:
    """The live cache and the tokens it holds; refuses a file made by another model."""
    cache, metadata = _load(path)
    saved = SavedPrompt.from_metadata(path, metadata)
    if saved.fingerprint != fingerprint:
        raise UserError(f"{path} was made by another model ({saved.model}, fingerprint "
                        f"{saved.fingerprint[:12]}); this one's is {fingerprint[:12]}. "
                        f"Remake it with `rewind cache-prompt` for this model.")
    return cache, saved.tokens


def save_cache_file(path: str, cache: list[Any], saved: SavedPrompt) -> None:
    """Write atomically: a crash leaves the old file or none, never half of one."""
    from mlx_lm.models.cache import save_prompt_cache

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial.safetensors")
    try:
        save_prompt_cache(str(partial), cache, saved.to_metadata())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cache-prompt", help="prefill a prompt and save its cache to a file",
        description="Prefill a prompt once and save the cache; "
                    "`rewind generate --prompt-cache-file` starts from it.")
    add_model_arg(parser)
    parser.add_argument("--prompt-file", required=True, help="file with the prompt ('-': stdin)")
    parser.add_argument("--out", required=True, help="the cache file to write")
    parser.add_argument("--chat", action="store_true",
                        help="cache the prompt as the start of a user message in the chat "
                             "template (use generate --chat with it)")
    add_cache_shape_args(parser)
    parser.add_argument("--verbose", action="store_true", help="print speed and sizes")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _cache_prompt(args)
    except UserError as exc:
        return fail(str(exc))


def _cache_prompt(args: argparse.Namespace) -> int:
    import mlx.core as mx

    if args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.prompt_file).read_text()
        except OSError as exc:
            raise UserError(f"cannot read --prompt-file: {exc}") from exc
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise UserError("--max-kv-size must be at least 1")
    loaded = load_or_explain(args.model, args.cpu_weights)
    tokens = encode_prefix(loaded.tokenizer, text, args.chat)
    cache = new_cache(loaded.model, args.max_kv_size, args.kv_bits, args.kv_group_size)
    started = time.perf_counter()
    prefill(loaded.model, tokens, cache)
    seconds = time.perf_counter() - started
    saved = SavedPrompt(model=str(loaded.path), fingerprint=loaded.fingerprint, tokens=tokens,
                        text=text, chat=args.chat, max_kv_size=args.max_kv_size,
                        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    save_cache_file(args.out, cache, saved)
    size = Path(args.out).stat().st_size
    print(f"cached {len(tokens)} tokens in {args.out} ({size / 1e6:.1f} MB)", file=sys.stderr)
    if args.verbose:
        from rewind.blas import status

        rate = len(tokens) / seconds if seconds > 0 else float("inf")
        print(f"Prompt: {len(tokens)} tokens, {rate:.1f} tokens/s", file=sys.stderr)
        print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB", file=sys.stderr)
        print(status(), file=sys.stderr)
    return 0
