"""`rewind generate`: one prompt in, streamed text out (optionally from a saved prompt cache).

What it shares with `rewind chat` and `rewind cache-prompt` (loading, options, the cache, the
reply stream and its report) is in rewind.commands.common.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rewind.commands.cache_prompt import load_cache_file, read_cache_metadata
from rewind.commands.common import (
    DEFAULT_MODEL,
    ReplyStats,
    UserError,
    add_cache_shape_args,
    add_model_arg,
    add_sampling_args,
    check_sampling_args,
    fail,
    load_or_explain,
    new_cache,
    print_report,
    reuse_cache,
    sampling_params_from,
    stream_reply,
)


# ---------------------------------------------------------------------------------------------
# Prompts


def read_prompt(text: str) -> str:
    """`-` reads the prompt from stdin; `\\n` and `\\t` escapes are expanded (as mlx-lm does)."""
    if text == "-":
        return sys.stdin.read()
    return text.replace("\\n", "\n").replace("\\t", "\t")


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of `text`, as a raw prompt or as one user message in the chat template."""
    if not chat:
        return list(tokenizer.encode(text))
    if not tokenizer.has_chat_template:
        raise UserError("--chat: this model's tokenizer has no chat template")
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))


# ---------------------------------------------------------------------------------------------
# The command


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from one prompt",
        description="Stream a model's continuation of a prompt to stdout.")
    add_model_arg(parser, default=None)
    parser.add_argument("--prompt", required=True, help="the prompt ('-' reads stdin)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the chat template")
    add_sampling_args(parser)
    add_cache_shape_args(parser)
    parser.add_argument("--prompt-cache-file", metavar="FILE", default=None,
                        help="start from a cache saved by `rewind cache-prompt`; the prompt "
                             "continues the cached one")
    parser.add_argument("--verbose", action="store_true",
                        help="print speed, peak memory and BLAS status to stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except UserError as exc:
        return fail(str(exc))


def _generate(args: argparse.Namespace) -> int:
    check_sampling_args(args)
    prompt = read_prompt(args.prompt)
    saved = read_cache_metadata(args.prompt_cache_file) if args.prompt_cache_file else None
    model_name = args.model or (saved.model if saved else DEFAULT_MODEL)
    loaded = load_or_explain(model_name, args.cpu_weights)
    tokenizer = loaded.tokenizer

    stats = ReplyStats()
    if saved is None:
        tokens = encode_prompt(tokenizer, prompt, args.chat)
        cache = new_cache(loaded.model, args.max_kv_size, args.kv_bits, args.kv_group_size)
        done = 0
    else:
        if saved.chat != args.chat:
            made = "with" if saved.chat else "without"
            raise UserError(f"{args.prompt_cache_file} was made {made} --chat; "
                            f"use generate {made} --chat")
        saved.check_shape(args.max_kv_size, args.kv_bits)
        cache, cached_tokens = load_cache_file(args.prompt_cache_file, loaded.fingerprint)
        tokens = encode_prompt(tokenizer, saved.text + prompt, args.chat)
        done = reuse_cache(cache, cached_tokens, tokens)
        if done < 0:
            # The tokenizer merged across the join into something the cache cannot be cut back
            # to: correctness first, recompute the whole prompt.
            print("rewind: note: the prompt does not extend the cached tokens; recomputing",
                  file=sys.stderr)
            cache = new_cache(loaded.model, saved.max_kv_size, saved.kv_bits,
                              saved.kv_group_size)
            done = 0
    stats.cached_tokens = done

    fed = list(tokens[:done])
    for text in stream_reply(loaded.model, tokenizer, tokens[done:], cache,
                             sampling_params_from(args),
                             args.max_tokens, stats, fed):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.verbose:
        print_report(stats, model=loaded.model)
    return 0
