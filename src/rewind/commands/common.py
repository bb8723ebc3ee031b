"""What `rewind generate`, `rewind chat` and `rewind cache-prompt` share: loading a model with a
clear error, the sampling and cache-shape options, building a cache, the reply stream and the
--verbose report. The prompt goes through the engine's runner (its chunk grid, its output head for
the last position only), with checkpoint hooks at block and message boundaries; generation through
rewind.engine.single with the server's sampler (the next step queued before the current token is
read), so callers know exactly which tokens the cache holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rewind.engine.request import SamplingParams

DEFAULT_MODEL = "default"


class UserError(Exception):
    """Bad input from the user: printed as one line, no traceback, non-zero exit."""


# ---------------------------------------------------------------------------------------------
# Options


def add_model_arg(parser: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL) -> None:
    parser.add_argument("--model", default=default,
                        help=f"registry name or model folder (default: {default})")
    add_cpu_weights_arg(parser)


def add_cpu_weights_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-weights", choices=("auto", "gguf", "exact", "int8"),
                        default="auto",
                        help="on the CPU, compute with the GGUF file the model came from, its "
                             "blocks read in place (gguf: the weights llama.cpp runs), the model "
                             "folder's weights (exact: bf16 for the default model), or int8 "
                             "copies of them; auto: gguf where the model came from a GGUF file "
                             "that is still there, else exact")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k likeliest (0: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p * max")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def add_cache_shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                        help="keep a rotating KV cache of the last N tokens")
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                        help="quantize the full-attention KV cache to this many bits")
    parser.add_argument("--kv-group-size", type=int, default=64,
                        help="group size of KV cache quantization (default 64)")


def check_sampling_args(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be at least 1")
    if args.temp < 0:
        raise UserError("--temp must be >= 0")
    if not 0.0 < args.top_p <= 1.0:
        raise UserError("--top-p must be in (0, 1]")
    if args.top_k < 0:
        raise UserError("--top-k must be >= 0")
    if not 0.0 <= args.min_p <= 1.0:
        raise UserError("--min-p must be in [0, 1]")
    if getattr(args, "max_kv_size", None) is not None and args.max_kv_size < 1:
        raise UserError("--max-kv-size must be at least 1")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    """The server's sampling settings for these flags (one sampler for every path)."""
    from rewind.engine.request import SamplingParams

    return SamplingParams(temperature=args.temp, top_p=args.top_p, min_p=args.min_p,
                          top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)


# ---------------------------------------------------------------------------------------------
# Model and cache


def load_or_explain(name_or_path: str, cpu_weights: str = "auto") -> Any:
    """rewind.models.loader.load_model, with a missing or broken model turned into a UserError."""
    from rewind.models.loader import cpu_weight_options, load_model

    try:
        from rewind.models.registry import ModelNotFoundError
    except ImportError:  # the registry is not built yet: the loader raises FileNotFoundError
        ModelNotFoundError = FileNotFoundError
    try:
        return load_model(name_or_path, **cpu_weight_options(cpu_weights))
    except (ModelNotFoundError, FileNotFoundError) as exc:
        raise UserError(str(exc) or f"model not found: {name_or_path}") from exc
    except ValueError as exc:  # mlx-lm: unsupported model type, missing weights, bad config
        raise UserError(f"cannot load model {name_or_path!r}: {exc}") from exc


def new_cache(model: Any, max_kv_size: int | None, kv_bits: int | None,
              kv_group_size: int = 64) -> list[Any]:
    """A fresh per-layer cache. With kv_bits, every full-attention KVCache starts quantized.

    mlx-lm quantizes only once the cache reaches a start offset and fails on sliding-window
    layers (RotatingKVCache has no quantized form); quantizing the full-attention layers from
    the first token works for every family and keeps a cache file's classes fixed.
    """
    from rewind.cache.kv import GrowingKVCache, make_cache

    cache = make_cache(model, max_kv_size=max_kv_size)
    if kv_bits is not None:
        head_dim = _head_dim(model)
        if head_dim is not None and head_dim % kv_group_size:
            raise UserError(f"--kv-group-size {kv_group_size} does not divide this model's "
                            f"attention head size {head_dim}; try 32 or 64")
        cache = [layer.to_quantized(group_size=kv_group_size, bits=kv_bits)
                 if type(layer) is GrowingKVCache else layer for layer in cache]
    return cache


def _head_dim(model: Any) -> int | None:
    """The attention head size from the model's args (nested under text_config for some)."""
    args = getattr(model, "args", None)
    fields = getattr(args, "text_config", None)
    if not isinstance(fields, dict):
        fields = vars(args) if args is not None else {}
    if fields.get("head_dim"):
        return int(fields["head_dim"])
    if fields.get("hidden_size") and fields.get("num_attention_heads"):
        return int(fields["hidden_size"]) // int(fields["num_attention_heads"])
    return None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reuse_cache(cache: list[Any], cached: Sequence[int], wanted: Sequence[int]) -> int:
    """Make `cache` (which holds `cached`) hold a prefix of `wanted`, leaving at least one token
    of `wanted` to compute. Returns that prefix's length, or -1 when the cache cannot be cut back
    to it (sliding-window past its window, recurrent state): the caller must start afresh."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    keep = min(common_prefix(cached, wanted), len(wanted) - 1)
    if keep == len(cached):
        return keep
    if keep <= 0 or not can_trim_prompt_cache(cache):
        return -1
    trim_prompt_cache(cache, len(cached) - keep)
    return keep


# ---------------------------------------------------------------------------------------------
# Prompts


def encode_prefix(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt's beginning: in chat form, the user message left open so that
    more text can follow it (what `cache-prompt --chat` stores)."""
    if not chat:
        return list(tokenizer.encode(text))
    if not tokenizer.has_chat_template:
        raise UserError("--chat: this model's tokenizer has no chat template")
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=False,
                                              continue_final_message=True))


# ---------------------------------------------------------------------------------------------
# The reply stream and its report


@dataclass
class ReplyStats:
    prompt_tokens: int = 0  # computed in this call
    cached_tokens: int = 0  # taken from a cache instead
    prompt_seconds: float = 0.0  # until the first generated token
    generation_tokens: int = 0
    generation_seconds: float = 0.0
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"
    peak_memory_bytes: int = 0


def prefill(model: Any, tokens: Sequence[int], cache: list[Any], start: int = 0,
            on_checkpoint: Callable[[int], None] | None = None,
            stops: Sequence[int] = (), logits: bool = False,
            block_tokens: int | None = None) -> Any:
    """Feed `tokens` into `cache` (which already holds `start` tokens) in the engine's calls
    (rewind.engine.runner: its chunk grid, and `stops`, absolute positions such as message
    boundaries). `on_checkpoint(n)` runs whenever the cache holds n tokens where a prompt cache
    with blocks of `block_tokens` (None: the default) checkpoints (rewind.cache.checkpoints: a
    block boundary, one of `stops`, or the prompt's last token but one). Returns the last
    position's logits [1, vocab] when `logits`."""
    from rewind.cache.checkpoints import BLOCK_TOKENS
    from rewind.engine.runner import ModelRunner

    runner = ModelRunner(model, block_tokens=block_tokens or BLOCK_TOKENS)
    hook = None if on_checkpoint is None else (lambda position, _: on_checkpoint(position))
    return runner.prefill(cache, tokens, start, stops, hook, logits=logits)


def stream_reply(model: Any, tokenizer: Any, tokens: Sequence[int], cache: list[Any],
                 params: SamplingParams, max_tokens: int, stats: ReplyStats,
                 fed: list[int] | None = None,
                 on_checkpoint: Callable[[int], None] | None = None,
                 stops: Sequence[int] = (), block_tokens: int | None = None) -> Iterator[str]:
    """Yield the reply's text as it comes. `cache` holds the len(fed) tokens before `tokens`.
    Every token fed to the model is appended to `fed`, so afterwards `fed` lists exactly what
    the cache holds: the prompt, and the generated tokens up to one past the last one read
    (the generator queues the next step before the current token is read). Fills `stats`.

    The prompt goes through the engine's runner (its calls, checkpoint hooks) and the decode
    loop through rewind.engine.single with the server's sampler, so the same settings give the
    same tokens as the server."""
    import mlx.core as mx

    from rewind.engine.runner import ModelRunner
    from rewind.engine.sampler import SequenceSampler
    from rewind.engine.single import decode_tokens

    fed = [] if fed is None else fed
    if not tokens:
        raise UserError("the prompt is empty")
    eos = set(tokenizer.eos_token_ids)
    started = time.perf_counter()
    stats.prompt_tokens = len(tokens)
    logits = prefill(model, tokens, cache, len(fed), on_checkpoint, stops, logits=True,
                     block_tokens=block_tokens)
    fed.extend(tokens)
    sampler = SequenceSampler(params, list(fed), int(logits.shape[-1]))
    generator = decode_tokens(ModelRunner(model), logits, cache, sampler, max_tokens)
    detokenizer = tokenizer.detokenizer
    generation_started = started
    stats.finish_reason = "length"
    try:
        for produced, (token, _) in enumerate(generator):
            if produced + 1 < max_tokens:  # the step after this token is queued: it is fed
                fed.append(token)
            if produced == 0:
                generation_started = time.perf_counter()
                stats.prompt_seconds = generation_started - started
            if token in eos:
                stats.finish_reason = "stop"
                break
            stats.generation_tokens += 1
            detokenizer.add_token(token)
            segment = detokenizer.last_segment  # reading it consumes it
            if segment:
                yield segment
    finally:
        generator.close()
    detokenizer.finalize()
    segment = detokenizer.last_segment
    if segment:
        yield segment
    # The first token comes from the prompt pass: generation speed counts the time after it.
    stats.generation_seconds = time.perf_counter() - generation_started
    stats.peak_memory_bytes = mx.get_peak_memory()


def print_report(stats: ReplyStats, out: Any = None, model: Any = None) -> None:
    from rewind.blas import status
    from rewind.models.loader import describe_compute

    out = out if out is not None else sys.stderr

    def rate(tokens: int, seconds: float) -> str:
        return f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "n/a"

    cached = f" (+{stats.cached_tokens} from cache)" if stats.cached_tokens else ""
    print("=" * 10, file=out)
    print(f"Prompt: {stats.prompt_tokens} tokens{cached}, "
          f"{rate(stats.prompt_tokens, stats.prompt_seconds)}", file=out)
    print(f"Generation: {stats.generation_tokens} tokens, "
          f"{rate(stats.generation_tokens, stats.generation_seconds)}", file=out)
    print(f"Peak memory: {stats.peak_memory_bytes / 1e9:.3f} GB", file=out)
    if model is not None:
        print(describe_compute(model), file=out)
    print(status(), file=out)


def fail(message: str) -> int:
    print(f"rewind: error: {message}", file=sys.stderr)
    return 1
