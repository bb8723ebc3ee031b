"""Structured output on the real default model (Gemma 3 270M): answers to JSON-schema requests
parse and validate, `json_object` gives whole objects, and `tool_choice: required` a call whose
arguments validate."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from live_server import Live, tiny_live_server
from test_structured_output import SCHEMAS, WEATHER

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    with tiny_live_server("default", tmp_path_factory.mktemp("scratch"),  # type: ignore[arg-type]
                          max_tokens=96) as server:
        yield server


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_answers_validate(live, name):
    reply = live.openai().chat.completions.create(
        model=live.model, temperature=0,
        messages=[{"role": "user", "content": "Answer in JSON: plan a weekend trip."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": SCHEMAS[name]}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[name])


def test_json_object_answers_are_objects(live):
    reply = live.openai().chat.completions.create(
        model=live.model, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}])
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_required_tool_call(live):
    reply = live.openai().chat.completions.create(
        model=live.model, temperature=0, tools=[WEATHER], tool_choice="required",
        messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    call = reply.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
