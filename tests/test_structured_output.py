"""Structured output enforced by a grammar (llguidance), through the real `openai` and `anthropic`
clients against a live server: JSON schemas (chat completions' response_format and the Responses
API's text.format), tool_choice `required` or named, invalid schemas as 400s, and constrained and
free requests in one batch giving each the tokens it gets alone. The tiny model is random: if its
answers parse and validate, the grammar did it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
from live_server import Live, openai_error, post, tiny_live_server

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
             "properties": {"city": {"type": "string", "maxLength": 16},
                            "days": {"type": "integer", "minimum": 1, "maximum": 14}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["trip"],
               "properties": {"trip": {
                   "type": "object", "additionalProperties": False,
                   "required": ["from", "to", "budget"],
                   "properties": {"from": {"type": "string", "maxLength": 10},
                                  "to": {"type": "string", "maxLength": 10},
                                  # An integer: greedy small models may write 1000.000...
                                  # until the cap in a JSON number, which no grammar bounds.
                                  "budget": {"type": "integer", "minimum": 0,
                                             "maximum": 5000}}}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["tags"],
              "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                      "items": {"type": "string", "maxLength": 8}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["mood", "ok"],
             "properties": {"mood": {"enum": ["happy", "sad", "neutral"]},
                            "ok": {"type": "boolean"}, "note": {"type": "string",
                                                                "maxLength": 6}}},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 8}}}}}
USER = [{"role": "user", "content": "Plan a short trip."}]


@pytest.fixture(scope="module")
def live(tiny_model_path, tmp_path_factory) -> Iterator[Live]:
    with tiny_live_server(tiny_model_path("llama"), tmp_path_factory.mktemp("scratch"),
                          max_tokens=160) as server:
        yield server


def json_format(name: str) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 7), (1.0, 8)])
def test_every_answer_validates_against_its_schema(live, name, temperature, seed):
    reply = live.openai().chat.completions.create(
        model=live.model, messages=USER, response_format=json_format(name),
        temperature=temperature, seed=seed)
    assert reply.choices[0].finish_reason == "stop"  # the grammar ended it, not the cap
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[name])


def test_json_object_streams_what_it_answers(live):
    """Any object: a random model's keys never end, so this checks the stream and the start; the
    default model's test checks whole objects."""
    body = {"model": live.model, "messages": USER, "response_format": {"type": "json_object"},
            "temperature": 0, "max_tokens": 40}
    chunks = live.openai().chat.completions.create(**body, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = live.openai().chat.completions.create(**body).choices[0].message.content
    assert streamed == plain and plain.startswith("{")


def test_responses_text_format_is_enforced(live):
    reply = live.openai().responses.create(
        model=live.model, input="Plan a short trip.", temperature=0,
        text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMAS["nested"],
                         "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), SCHEMAS["nested"])


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 3)])
def test_tool_choice_always_yields_a_valid_call(live, choice, names, temperature, seed):
    reply = live.openai().chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice=choice, temperature=temperature, seed=seed)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in names
    schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        schema["function"]["parameters"])


def test_anthropic_tool_choice_any_and_responses_required(live):
    tools = [{"name": f["function"]["name"], "description": f["function"]["description"],
              "input_schema": f["function"]["parameters"]} for f in (WEATHER, TIME)]
    message = live.anthropic().messages.create(
        model=live.model, max_tokens=160, tools=tools, tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    reply = live.openai().responses.create(
        model=live.model, input="Weather in Paris?", tool_choice="required", temperature=0,
        tools=[{"type": "function", **WEATHER["function"]}])
    calls = [item for item in reply.output if item.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments)["unit"] in ("C", "F")


def test_constrained_and_free_requests_share_a_batch(live):
    def ask(index: int) -> str:
        extra = {"response_format": json_format(sorted(SCHEMAS)[index % 4])} if index % 2 \
            else {"max_tokens": 24}
        reply = live.openai().chat.completions.create(
            model=live.model, temperature=0,
            messages=[{"role": "user", "content": f"Request number {index}."}], **extra)
        return reply.choices[0].message.content or ""

    alone = [ask(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone


@pytest.mark.parametrize("response_format,problem", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}, "grammar"),
])
def test_invalid_schemas_are_a_400_naming_the_problem(live, response_format, problem):
    body = {"messages": USER, "response_format": response_format}
    error = openai_error(post(live, "/v1/chat/completions", body), 400)
    assert problem in error["message"]


def test_a_tool_choice_naming_no_tool_is_a_400(live):
    body = {"messages": USER, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert openai_error(post(live, "/v1/chat/completions", body), 400)["param"] == "tool_choice"
