"""Unit tests of the server's pure parts: output splitting, tool-call parsing, chat formatting,
error shapes, API-key reading. No server, no engine."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rewind.server.auth import ApiKey, KeyRing, presented_key
from rewind.server.chat_format import ChatFormatter
from rewind.server.errors import ApiError, error_body, validation_message
from rewind.server.responses_api import _Output
from rewind.server.schemas import ChatCompletionRequest, MessagesRequest
from rewind.server.tool_parsing import (
    OutputFormat,
    OutputSplitter,
    Piece,
    ToolCall,
    collect,
    merge_pieces,
    parse_tool_calls,
)

FMT = OutputFormat()


def run_split(text: str, step: int = 1, **kwargs) -> list[Piece]:
    """Feed `text` `step` characters at a time (tags split across feeds), then finish."""
    splitter = OutputSplitter(FMT, **kwargs)
    pieces = []
    for at in range(0, len(text), step):
        pieces += splitter.feed(text[at:at + step])
    return merge_pieces(pieces + splitter.finish())


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_content_and_tool_call_split_at_any_boundary(step):
    text = ('<think>\nweather first</think>\n\nLet me look.<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>')
    pieces = run_split(text, step, parse_tools=True)
    content, reasoning, calls = collect(pieces)
    assert reasoning == "weather first"
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                   {"city": "Berlin"})]
    assert calls[0].id.startswith("call_")


def test_text_that_only_looks_like_a_tag_start_is_released():
    pieces = run_split("a < b and <thin ice>", 1, parse_tools=True)
    assert collect(pieces)[0] == "a < b and <thin ice>"


def test_start_in_reasoning_when_the_prompt_opened_a_think_block():
    pieces = run_split("plan it</think>done", 2, parse_tools=False, start_in_reasoning=True)
    assert [(p.kind, p.text) for p in pieces] == [("reasoning", "plan it"), ("content", "done")]


def test_tool_tags_are_plain_text_without_tools():
    text = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    assert collect(run_split(text, 3, parse_tools=False))[0] == text


def test_unterminated_tool_call_is_parsed_at_the_end():
    pieces = run_split('<tool_call>{"name": "ls", "arguments": {"path": "/"}}', 4,
                       parse_tools=True)
    calls = collect(pieces)[2]
    assert calls[0].name == "ls" and calls[0].arguments_dict() == {"path": "/"}


def test_unreadable_tool_call_comes_back_as_text():
    pieces = run_split("<tool_call>not json</tool_call>after", 1, parse_tools=True)
    content, _, calls = collect(pieces)
    assert calls == [] and content == "<tool_call>not json</tool_call>after"


def test_several_calls_and_string_arguments():
    body = '[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b", "parameters": {"y": 2}}]'
    calls = parse_tool_calls(body, FMT, None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    with pytest.raises(ValueError):
        parse_tool_calls('{"arguments": {}}', FMT, None)


def test_family_parser_from_mlx_lm_reads_qwen3_coder_xml():
    from mlx_lm.tool_parsers import qwen3_coder

    fmt = OutputFormat(tool_start=qwen3_coder.tool_call_start, tool_end=qwen3_coder.tool_call_end,
                       parse_body=qwen3_coder.parse_tool_call, native_tools=True)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    splitter = OutputSplitter(fmt, parse_tools=True, tools=tools)
    text = "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n</function>\n</tool_call>"
    pieces = [p for ch in text for p in splitter.feed(ch)] + splitter.finish()
    calls = collect(pieces)[2]
    assert calls[0].name == "add" and calls[0].arguments_dict() == {"a": 3}


def test_output_format_from_a_tokenizer_without_tool_support(tiny_loaded):
    fmt = OutputFormat.from_tokenizer(tiny_loaded("llama").tokenizer)
    assert (fmt.think_start, fmt.think_end) == ("<think>", "</think>")
    assert fmt.tool_start == "<tool_call>" and not fmt.native_tools


# ---------------------------------------------------------------- chat formatting


@pytest.fixture(scope="module")
def formatter(tiny_loaded):
    tokenizer = tiny_loaded("llama").tokenizer
    return ChatFormatter(tokenizer, OutputFormat.from_tokenizer(tokenizer))


def test_checkpoints_mark_the_end_of_the_last_turn_and_of_the_prompt(formatter):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is two plus two?"}]
    prompt = formatter.render(messages, template_kwargs={"enable_thinking": False})
    turn_end, prompt_end = prompt.checkpoints
    assert prompt_end == len(prompt.tokens) and 0 < turn_end < prompt_end
    without_generation_prompt = formatter.encode(formatter.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, enable_thinking=False))
    assert prompt.tokens[:turn_end] == without_generation_prompt[:turn_end]
    assert not prompt.start_in_reasoning


def test_next_turn_shares_the_prefix_up_to_the_checkpoint(formatter):
    first = [{"role": "user", "content": "Tell me about Paris."}]
    prompt = formatter.render(first, template_kwargs={"enable_thinking": True})
    assert prompt.start_in_reasoning  # the tiny template opens <think> in the generation prompt
    second = first + [{"role": "assistant", "content": "It is in France.",
                       "reasoning_content": "recall geography"},
                      {"role": "user", "content": "And Berlin?"}]
    next_prompt = formatter.render(second, template_kwargs={"enable_thinking": True})
    turn_end = prompt.checkpoints[0]
    assert next_prompt.tokens[:turn_end] == prompt.tokens[:turn_end]


def test_tools_become_a_system_prompt_and_tool_traffic_text(formatter):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Weather in Berlin?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Berlin"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]
    prompt = formatter.render(messages, tools, tool_choice="required")
    text = formatter.tokenizer.decode(prompt.tokens)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert "You must call at least one function." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}' in text
    assert "<tool_response>\nrainy\n</tool_response>" in text


def test_plain_text_conversations_alternate_roles():
    from rewind.server.chat_format import _as_plain_text

    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                {"role": "user", "content": "C"}, {"role": "system", "content": "D"},
                {"role": "assistant", "content": "E"}, {"role": "tool", "content": "F"}]
    assert _as_plain_text(messages) == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "C\n\nD"},
        {"role": "assistant", "content": "E"},
        {"role": "user", "content": "<tool_response>\nF\n</tool_response>"}]


def test_a_trailing_assistant_message_is_continued(formatter):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    prompt = formatter.render(messages)
    assert formatter.tokenizer.decode(prompt.tokens).endswith("Hello th")
    assert prompt.checkpoints == [len(prompt.tokens)]


def test_empty_messages_are_refused(formatter):
    with pytest.raises(ApiError) as err:
        formatter.render([])
    assert err.value.status == 400


# ---------------------------------------------------------------- responses output items


def test_responses_output_items_and_events():
    output = _Output()
    events = []
    for piece in [Piece("reasoning", "hm"), Piece("content", "Hi"), Piece("content", "!"),
                  Piece("tool_call", tool_call=ToolCall("call_9", "ls", '{"path": "."}'))]:
        events += output.add(piece)
    events += output.close()
    names = [name for name, _ in events]
    assert names[:3] == ["response.output_item.added", "response.content_part.added",
                         "response.reasoning_text.delta"]
    assert names.count("response.output_text.delta") == 2
    assert names[-4:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    kinds = [item["type"] for item in output.items]
    assert kinds == ["reasoning", "message", "function_call"]
    assert output.items[1]["content"][0]["text"] == "Hi!"
    assert output.items[2]["call_id"] == "call_9" and output.items[2]["status"] == "completed"


# ---------------------------------------------------------------- errors, schemas, auth


def test_error_shapes():
    error = ApiError(413, "too_large", "too big")
    assert error_body(error, "openai") == {"error": {"message": "too big",
                                                     "type": "invalid_request_error",
                                                     "param": None, "code": None}}
    assert error_body(error, "anthropic") == {"type": "error", "error": {
        "type": "request_too_large", "message": "too big"}}


def test_wrong_types_name_the_field():
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "temperature": "hot"})
    message, param = validation_message(err.value.errors())
    assert param == "temperature" and "temperature" in message
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})


def test_api_key_from_either_header():
    assert presented_key({"authorization": "Bearer sk-1"}) == "sk-1"
    assert presented_key({"x-api-key": "sk-2"}) == "sk-2"
    assert presented_key({"authorization": "Basic abc"}) is None
    ring = KeyRing([ApiKey("sk-1", "one")])
    assert ring.match("sk-1") is ring.keys[0] and ring.match("sk-2") is None
    assert ring.match(None) is None
