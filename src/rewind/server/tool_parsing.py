"""Split a model's streamed text into answer text, reasoning and tool calls.

Models write reasoning between think tags (`<think>...</think>`) and tool calls in their own
format: JSON between `<tool_call>` tags (Qwen, Hermes, our own prompt for templates without tool
support), or another format mlx-lm knows a parser for (Qwen3-Coder XML, Mistral, ...). The tags
come from mlx-lm's tokenizer inference, so every family it knows works here too; the body of a
tool call goes through mlx-lm's parser for that family (JSON when there is none).

The splitter works on text as it streams: text that may be the start of a tag is held back until
the next piece decides it, so a tag split over several tokens is still found.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from rewind.server.errors import bad_request

log = logging.getLogger(__name__)

ToolParser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools) signature


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (what OpenAI clients expect)

    def arguments_dict(self) -> dict[str, Any]:
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {"value": value}


@dataclass
class Piece:
    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _json_tool_parser(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


@dataclass(frozen=True)
class OutputFormat:
    """The tags one model family uses, and how to read a tool call's body."""

    think_start: str | None = "<think>"
    think_end: str | None = "</think>"
    tool_start: str = "<tool_call>"
    tool_end: str = "</tool_call>"
    parse_body: ToolParser = field(default=_json_tool_parser)
    native_tools: bool = False  # the chat template renders tools itself

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> OutputFormat:
        """Tags as mlx-lm inferred them from the template and vocabulary; JSON-in-tags otherwise."""
        think_start = getattr(tokenizer, "think_start", None) or "<think>"
        think_end = getattr(tokenizer, "think_end", None) or "</think>"
        if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_call_start:
            return cls(think_start, think_end, tokenizer.tool_call_start,
                       tokenizer.tool_call_end or "", tokenizer.tool_parser or _json_tool_parser,
                       native_tools=True)
        template = getattr(tokenizer, "chat_template", None)
        native = isinstance(template, str) and "tools" in template
        return cls(think_start, think_end, native_tools=native)


def call_arguments(raw: str | dict[str, Any], where: str, param: str) -> dict[str, Any]:
    """A tool call's arguments sent back by a client: a JSON object in a string (the APIs'
    form), or the object itself (which some clients send); anything else is a 400."""
    if isinstance(raw, dict):
        return raw
    try:
        arguments = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        raise bad_request(f"{where}: arguments are not JSON: {exc}", param=param) from exc
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}: arguments must be a JSON object", param=param)
    return arguments


def json_tool_format(fmt: OutputFormat) -> bool:
    """Tool calls written as one JSON object between the tags (Hermes / Qwen / our prompt)."""
    return fmt.parse_body is _json_tool_parser


def parse_tool_calls(body: str, fmt: OutputFormat, tools: list[dict[str, Any]] | None,
                     id_prefix: str = "call_") -> list[ToolCall]:
    """The tool call(s) written between a start and an end tag; ValueError when unreadable."""
    try:
        parsed = fmt.parse_body(body, tools)
    except (ValueError, KeyError, TypeError, SyntaxError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"unreadable tool call: {exc}") from exc
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"a tool call needs a name: {item!r}")
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:  # keep text that already is JSON; wrap anything else as a JSON string
                json.loads(arguments)
            except json.JSONDecodeError:
                arguments = json.dumps(arguments)
        else:
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        call_id = item.get("id") if isinstance(item.get("id"), str) else new_call_id(id_prefix)
        calls.append(ToolCall(call_id, item["name"], arguments))
    return calls


State = Literal["content", "reasoning", "tool"]


class OutputSplitter:
    """Streaming text in, pieces out: content, reasoning, and complete tool calls."""

    def __init__(self, fmt: OutputFormat, *, parse_tools: bool, start_in_reasoning: bool = False,
                 tools: list[dict[str, Any]] | None = None, id_prefix: str = "call_") -> None:
        self.fmt = fmt
        self.parse_tools = parse_tools
        self.tools = tools
        self.id_prefix = id_prefix
        self.state: State = "reasoning" if start_in_reasoning and fmt.think_end else "content"
        self._buffer = ""
        self._tool_body = ""
        self._trim_leading = start_in_reasoning  # newlines right after a tag are layout, not text
        self.saw_tool_call = False

    def _markers(self) -> list[tuple[str, State]]:
        """(tag, state it leads to) for the tags that matter in the current state."""
        if self.state == "reasoning":
            return [(self.fmt.think_end, "content")] if self.fmt.think_end else []
        if self.state == "tool":
            return [(self.fmt.tool_end, "content")] if self.fmt.tool_end else []
        markers: list[tuple[str, State]] = []
        if self.fmt.think_start:
            markers.append((self.fmt.think_start, "reasoning"))
        if self.parse_tools and self.fmt.tool_start:
            markers.append((self.fmt.tool_start, "tool"))
        return markers

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            markers = self._markers()
            found: tuple[int, str, State] | None = None
            for tag, next_state in markers:
                at = self._buffer.find(tag)
                if at >= 0 and (found is None or at < found[0]):
                    found = (at, tag, next_state)
            if found is None:
                hold = _held_back(self._buffer, [tag for tag, _ in markers])
                cut = len(self._buffer) - hold
                self._emit(self._buffer[:cut], pieces)
                self._buffer = self._buffer[cut:]
                return pieces
            at, tag, next_state = found
            self._emit(self._buffer[:at], pieces)
            self._buffer = self._buffer[at + len(tag):]
            if self.state == "tool":
                self._close_tool(pieces, tag)
            self.state = next_state
            self._trim_leading = True

    def finish(self) -> list[Piece]:
        """End of generation: release what was held back; an unterminated tool call is parsed if
        it can be (a model may stop at EOS instead of writing the end tag), else kept as text."""
        pieces: list[Piece] = []
        self._emit(self._buffer, pieces)
        self._buffer = ""
        if self.state == "tool":
            self._close_tool(pieces, "")
            self.state = "content"
        return pieces

    def _emit(self, text: str, pieces: list[Piece]) -> None:
        if self.state == "tool":
            self._tool_body += text
            return
        if self._trim_leading:
            text = text.lstrip("\n")
            if text:
                self._trim_leading = False
        if not text:
            return
        kind: Literal["content", "reasoning"] = "reasoning" if self.state == "reasoning" else "content"
        if pieces and pieces[-1].kind == kind:
            pieces[-1].text += text
        else:
            pieces.append(Piece(kind, text))

    def _close_tool(self, pieces: list[Piece], end_tag: str) -> None:
        body, self._tool_body = self._tool_body, ""
        try:
            calls = parse_tool_calls(body, self.fmt, self.tools, self.id_prefix)
        except ValueError as exc:
            log.warning("%s; returned as text", exc)
            pieces.append(Piece("content", self.fmt.tool_start + body + end_tag))
            return
        self.saw_tool_call = True
        pieces.extend(Piece("tool_call", tool_call=call) for call in calls)


def _held_back(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:length]):
                best = length
                break
    return best


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Consecutive text pieces of one kind as one (a whole answer's blocks / items)."""
    merged: list[Piece] = []
    for piece in pieces:
        if merged and piece.kind != "tool_call" and merged[-1].kind == piece.kind:
            merged[-1] = Piece(piece.kind, merged[-1].text + piece.text)
        else:
            merged.append(piece)
    return merged


def collect(pieces: list[Piece]) -> tuple[str, str, list[ToolCall]]:
    """Pieces -> (content, reasoning, tool calls), for non-streaming answers."""
    content = "".join(p.text for p in pieces if p.kind == "content")
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    calls = [p.tool_call for p in pieces if p.tool_call is not None]
    return content, reasoning, calls
