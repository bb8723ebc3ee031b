"""`rewind chat`: a multi-turn terminal chat with one model.

Every turn renders the whole conversation with the tokenizer's chat template (so earlier
reasoning is dropped exactly as the template says) and reuses what is already computed:

1. the live cache of the previous turn, when the new prompt extends what it holds or it can be
   trimmed back to the point where they part (full-attention layers);
2. otherwise rewind.cache.PromptCache, which restores the longest checkpointed prefix even for
   sliding-window and linear-attention layers that cannot be trimmed;
3. otherwise (--no-prompt-cache) a fresh cache.
Both paths checkpoint the prompt into the PromptCache where the server does
(rewind.cache.checkpoints: every block, message boundaries, the prompt's last token but one).

Lines starting with / are commands: /reset forgets the conversation, /exit (or end of input)
leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rewind.commands.common import (
    ReplyStats,
    UserError,
    add_model_arg,
    add_sampling_args,
    check_sampling_args,
    fail,
    load_or_explain,
    sampling_params_from,
    new_cache,
    print_report,
    reuse_cache,
    stream_reply,
)

HELP = "commands: /reset (forget the conversation), /exit (leave), /help"


def split_reasoning(reply: str, opened: bool, start: str = "<think>",
                    end: str = "</think>") -> tuple[str, str]:
    """(reasoning, answer) of a reply. `opened`: the prompt already opened the reasoning."""
    text = reply
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return "", text.strip()
        text = stripped[len(start):]
    if end not in text:
        return text.strip(), ""  # cut off while still reasoning
    reasoning, answer = text.split(end, 1)
    return reasoning.strip(), answer.strip()


class ChatSession:
    """One conversation: its messages, the live cache and the tokens that cache holds."""

    def __init__(self, loaded: Any, args: argparse.Namespace, prompt_cache: Any) -> None:
        self.loaded = loaded
        self.args = args
        self.prompt_cache = prompt_cache
        self.sampling = sampling_params_from(args)
        self.thinking = loaded.tokenizer.has_thinking and not args.no_think
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = []
        if self.args.system:
            self.messages.append({"role": "system", "content": self.args.system})
        self.cache: list[Any] | None = None
        self.fed: list[int] = []  # exactly the tokens self.cache holds

    def drop_unanswered(self) -> None:
        """After an interrupted reply: the last user message goes, and so does the live cache."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()
        self.cache, self.fed = None, []

    def prompt_tokens(self) -> list[int]:
        return list(self.loaded.tokenizer.apply_chat_template(
            self.messages, add_generation_prompt=True, enable_thinking=self.thinking))

    def divergence_points(self, tokens: list[int]) -> list[int]:
        """Where the next turn's prompt may part from this one: the end of the last message,
        and the end of the assistant header before any reasoning opener. Checkpoints there make
        dropping the reply's reasoning cost only the new content."""
        tokenizer = self.loaded.tokenizer
        points = []
        for rendered in (
            tokenizer.apply_chat_template(self.messages, add_generation_prompt=False),
            tokenizer.apply_chat_template(self.messages, add_generation_prompt=True,
                                          enable_thinking=False),
        ):
            if 0 < len(rendered) < len(tokens) and list(rendered) == tokens[:len(rendered)]:
                points.append(len(rendered))
        return sorted(set(points))

    def turn(self, user_text: str, out: Any) -> ReplyStats:
        """Send one user message, stream the reply to `out`, remember both."""
        from rewind.cache.checkpoints import block_tokens_of
        from rewind.cache.records import cache_offset

        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        self.messages.append({"role": "user", "content": user_text})
        tokens = self.prompt_tokens()
        points = self.divergence_points(tokens)
        stats = ReplyStats()
        done = reuse_cache(self.cache, self.fed, tokens) if self.cache is not None else -1
        if done >= 0:
            cache = self.cache
        elif self.prompt_cache is not None:
            restored = self.prompt_cache.restore(tokens, max_kv_size=self.args.max_kv_size)
            cache, done = restored.cache, restored.tokens
        else:
            cache, done = new_cache(model, self.args.max_kv_size, None), 0
        self.cache, self.fed = cache, list(tokens[:done])
        stats.cached_tokens = done

        def checkpoint(n: int) -> None:
            if self.prompt_cache is not None:
                self.prompt_cache.checkpoint(tokens[:n], cache)

        pieces: list[str] = []
        for text in stream_reply(model, tokenizer, tokens[done:], cache, self.sampling,
                                 self.args.max_tokens, stats, self.fed,
                                 on_checkpoint=checkpoint, stops=points,
                                 block_tokens=block_tokens_of(self.prompt_cache)):
            pieces.append(text)
            out.write(text)
            out.flush()
        out.write("\n")
        out.flush()
        if cache_offset(cache) not in (None, len(self.fed)):
            self.cache, self.fed = None, []  # never guess what a cache holds
        reasoning, answer = split_reasoning("".join(pieces), opened=self.thinking,
                                            start=tokenizer.think_start or "<think>",
                                            end=tokenizer.think_end or "</think>")
        message = {"role": "assistant", "content": answer}
        if reasoning:
            message["reasoning_content"] = reasoning
        self.messages.append(message)
        return stats


def _read_line(interactive: bool) -> str | None:
    """The next line the user typed, or None at the end of input."""
    try:
        if interactive:
            return input(">>> ")
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    except EOFError:
        return None


def _open_prompt_cache(loaded: Any, args: argparse.Namespace) -> Any:
    if args.no_prompt_cache:
        return None
    from rewind.cache import PromptCache
    from rewind.config import CacheConfig, parse_size

    try:
        ram_bytes = parse_size(args.cache_ram)
    except ValueError as exc:
        raise UserError(f"--cache-ram: {exc}") from exc
    config = CacheConfig(ram_bytes=ram_bytes, disk_enabled=not args.no_disk_cache)
    return PromptCache(loaded.model, loaded.fingerprint, config)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="multi-turn chat in the terminal",
        description="Chat with a model in the terminal; the cache is reused across turns. "
                    + HELP)
    add_model_arg(parser)
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--no-think", action="store_true",
                        help="ask the chat template not to open a reasoning block")
    add_sampling_args(parser)
    parser.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                        help="keep a rotating KV cache of the last N tokens")
    parser.add_argument("--no-prompt-cache", action="store_true",
                        help="keep only the live cache (no checkpoints to restore from)")
    parser.add_argument("--no-disk-cache", action="store_true",
                        help="keep prompt-cache checkpoints in RAM only")
    parser.add_argument("--cache-ram", default="1GiB", help="RAM for checkpoints (default 1GiB)")
    parser.add_argument("--verbose", action="store_true",
                        help="after each reply print cached tokens, speed and memory to stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _chat(args)
    except UserError as exc:
        return fail(str(exc))


def _chat(args: argparse.Namespace) -> int:
    check_sampling_args(args)
    loaded = load_or_explain(args.model, args.cpu_weights)
    if not loaded.tokenizer.has_chat_template:
        raise UserError(f"{args.model} has no chat template; use `rewind generate` instead")
    prompt_cache = _open_prompt_cache(loaded, args)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[{loaded.name}] {HELP}", file=sys.stderr)
    session = ChatSession(loaded, args, prompt_cache)
    try:
        while True:
            line = _read_line(interactive)
            if line is None or line.strip() in ("/exit", "/quit"):
                return 0
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                session.reset()
                print("(conversation reset)", file=sys.stderr)
                continue
            if text.startswith("/"):
                print(HELP, file=sys.stderr)
                continue
            try:
                stats = session.turn(text, sys.stdout)
            except KeyboardInterrupt:
                # Stop this reply, keep the chat: forget the unanswered message and the live
                # cache, whose contents are unknown now (checkpoints in the PromptCache stay).
                print("\n(reply interrupted)", file=sys.stderr)
                session.drop_unanswered()
                continue
            if args.verbose:
                print_report(stats, model=loaded.model)
    finally:
        if prompt_cache is not None:
            prompt_cache.close()
