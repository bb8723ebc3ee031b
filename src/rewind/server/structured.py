"""Structured output, enforced by a grammar (rewind.engine.grammar), not asked for in the prompt:
`response_format` (chat completions), the Responses API's `text.format`, and `tool_choice`
`required` or a named function, which must yield a well-formed call.

Each request kind turns into one llguidance grammar text here; the engine masks every step of
the row with it. A schema llguidance cannot compile is a 400 naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rewind.server.errors import bad_request
from rewind.server.tool_parsing import OutputFormat, json_tool_format

ANY_OBJECT: dict[str, Any] = {"type": "object"}


Tags = Mapping[str, int]  # text of each added (special) token -> its id


def _lark_text(text: str, tags: Tags) -> str:
    """A piece of text in Lark: a special token by its id (llguidance sees a special token as
    that token, not as its text), anything else as a quoted literal."""
    return f"<[{tags[text]}]>" if text in tags else json.dumps(text)


def json_grammar(schema: Any, param: str, *, before: Sequence[str] = (),
                 after: Sequence[str] = (), tags: Tags | None = None) -> str:
    """The grammar of the `before` pieces, then JSON text that validates against `schema`, then
    the `after` pieces (a Lark grammar with llguidance's %json; its JSON is compact, so a model
    cannot pad it with whitespace forever)."""
    if not isinstance(schema, dict):
        raise bad_request("the JSON schema must be an object", param=param)
    from llguidance import LLMatcher

    tags = tags or {}
    parts = [_lark_text(t, tags) for t in before if t] + ["value"]
    parts += [_lark_text(t, tags) for t in after if t]
    compact = {**schema, "x-guidance": {**schema.get("x-guidance", {}),
                                        "whitespace_flexible": False}}
    lark = f"start: {' '.join(parts)}\nvalue: %json {json.dumps(compact)}\n"
    return LLMatcher.grammar_from_lark(lark)


def _closing(fmt: OutputFormat, opens_reasoning: bool) -> str:
    """What the answer must write first: the end of a reasoning block its prompt opened."""
    return fmt.think_end if opens_reasoning and fmt.think_end else ""


def response_format_grammar(kind: str, json_schema: Any, fmt: OutputFormat,
                            opens_reasoning: bool, tags: Tags,
                            param: str = "response_format") -> str | None:
    """OpenAI's response_format / Responses' text.format -> a grammar (None for plain text)."""
    if kind == "text":
        return None
    before = [_closing(fmt, opens_reasoning)]
    if kind == "json_object":
        return json_grammar(ANY_OBJECT, param, before=before, tags=tags)
    if kind == "json_schema":
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
            raise bad_request('a json_schema response format needs {"name": ..., "schema": '
                              '{...}}', param=param)
        return json_grammar(json_schema["schema"], param, before=before, tags=tags)
    raise bad_request(f"unknown response format type {kind!r} (text, json_object, json_schema)",
                      param=param)


def responses_text_format(text: dict[str, Any] | None) -> tuple[str, Any, str] | None:
    """The Responses API's text.format ({"type": "json_schema", "name", "schema", "strict"})
    as request_grammar's response_format."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise bad_request("text.format must be an object with a type", param="text.format")
    return spec["type"], spec, "text.format"


def tool_call_grammar(tools: list[dict[str, Any]], choice: str | None, fmt: OutputFormat,
                      opens_reasoning: bool, tags: Tags) -> str | None:
    """For tool_choice `required` or a function's name: exactly one call, in the model's own
    tool-call tags, of a tool offered, with arguments that validate against its parameters.
    None for `auto` / `none` / no tools, and for tool-call formats that are not JSON in tags
    (Qwen3-Coder's XML, Mistral's...), which keep the prompt's instruction alone."""
    if not tools or choice in (None, "auto", "none"):
        return None
    chosen = [t["function"] for t in tools
              if choice == "required" or t["function"].get("name") == choice]
    if not chosen:
        raise bad_request(f"tool_choice names {choice!r}, which is not among the tools",
                          param="tool_choice")
    if not json_tool_format(fmt):
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": function["name"]},
                             "arguments": function.get("parameters") or ANY_OBJECT}}
             for function in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return json_grammar(schema, "tools",
                        before=[_closing(fmt, opens_reasoning), fmt.tool_start, "\n"],
                        after=["\n", fmt.tool_end], tags=tags)


def request_grammar(fmt: OutputFormat, tags: Tags, opens_reasoning: bool,
                    tools: list[dict[str, Any]], choice: str | None,
                    response_format: tuple[str, Any, str] | None = None) -> str | None:
    """The one grammar a request's answer must follow, or None. `tags`: the tokenizer's added
    tokens (ServerRuntime.added_tokens); `response_format`: (type, the format object, the
    parameter's name for errors)."""
    calls = tool_call_grammar(tools, choice, fmt, opens_reasoning, tags)
    answer = None
    if response_format is not None:
        kind, spec, param = response_format
        answer = response_format_grammar(kind, spec, fmt, opens_reasoning, tags, param=param)
    if calls is not None and answer is not None:
        raise bad_request("a required tool call and a JSON answer cannot both be enforced: ask "
                          "for one of them", param="tool_choice")
    return calls or answer
