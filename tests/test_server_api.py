"""The HTTP server against a live uvicorn on loopback, with the real engine and prompt cache on a
tiny random model, spoken to by the real `openai` and `anthropic` clients (and httpx for raw
bodies). Random weights write garbage, so tests check structure, counts and equalities between
paths; tool calls are produced by a prefilled assistant turn that the model must close."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from live_server import (
    Live,
    anthropic_error,
    openai_error,
    post,
    start_server,
    tiny_live_server,
)

from rewind.config import EngineConfig, ServerConfig
from rewind.engine import Engine
from rewind.models.loader import load_model
from rewind.server.app import create_app

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_PREFILL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n'
BODY_LIMIT = 256 << 10


@pytest.fixture(scope="module")
def live(tiny_model_path, tmp_path_factory) -> Iterator[Live]:
    with tiny_live_server(tiny_model_path("llama"), tmp_path_factory.mktemp("scratch"),
                          max_body_bytes=BODY_LIMIT) as server:
        yield server


def wait_idle(engine: Engine, seconds: float = 30.0) -> dict[str, Any]:
    """Poll (bounded) until the engine holds no request."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["queued"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine is still busy: {engine.stats()}")


def never_stop(engine: Engine) -> dict[str, float]:
    """A logit_bias that bans every end-of-sequence token: the request runs until cancelled."""
    return {str(token): -100.0 for token in engine.eos_token_ids}


def sse_lines(lines: Iterator[str], count: int) -> list[str]:
    """The next `count` data lines of a streaming response's line iterator. Keep the iterator
    referenced while the stream should stay open: httpx closes the response when it is dropped."""
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line)
            if len(data) == count:
                break
    return data


# ---------------------------------------------------------------- basics


def test_health_models_and_metrics(live):
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    models = live.openai().models.list()
    assert [m.id for m in models.data] == [live.model]
    metrics = httpx.get(f"{live.url}/metrics").text
    for name in ("rewind_time_to_first_token_seconds", "rewind_inter_token_latency_seconds",
                 "rewind_queue_depth", "rewind_running_sequences", "rewind_mlx_active_memory_bytes",
                 "rewind_mlx_peak_memory_bytes", "rewind_mlx_cache_memory_bytes",
                 'rewind_prompt_cache_bytes{tier="disk"}', 'rewind_cached_prompt_tokens_total'):
        assert name in metrics


def test_plain_and_streaming_chat_give_the_same_greedy_text(live):
    client = live.openai()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=live.model, messages=messages, max_tokens=8,
                                           temperature=0, extra_body=NO_THINKING)
    choice = plain.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert plain.usage.completion_tokens <= 8 and plain.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(
        model=live.model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_THINKING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        plain.usage.completion_tokens


def test_reasoning_goes_to_reasoning_content(live):
    # The tiny template opens <think> in the generation prompt when thinking is on.
    reply = live.openai().chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "Think about Paris."}],
        max_tokens=6, temperature=0)
    message = reply.choices[0].message
    assert message.reasoning_content and message.content is None


def test_text_completions_plain_and_streaming(live):
    client = live.openai()
    plain = client.completions.create(model=live.model, prompt="Once upon a time", max_tokens=6,
                                      temperature=0)
    streamed = list(client.completions.create(model=live.model, prompt="Once upon a time",
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    assert plain.usage.completion_tokens == 6 and plain.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- tools


def test_tool_call_round_trip(live):
    client = live.openai()
    eos = live.loaded.tokenizer.eos_token_id
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Berlin?"}]
    # The assistant turn starts a tool call; the model is made to end it at once (EOS), and the
    # server must read the call out of the model's own text.
    first = client.chat.completions.create(
        model=live.model, messages=messages + [{"role": "assistant", "content": TOOL_PREFILL}],
        tools=[WEATHER_TOOL], max_tokens=4, temperature=0, logit_bias={str(eos): 100})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}

    streamed = list(client.chat.completions.create(
        model=live.model, messages=messages + [{"role": "assistant", "content": TOOL_PREFILL}],
        tools=[WEATHER_TOOL], max_tokens=4, temperature=0, logit_bias={str(eos): 100},
        stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices and
              c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].index == 0
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "rainy"}'}]
    second = client.chat.completions.create(model=live.model, messages=messages,
                                            tools=[WEATHER_TOOL], max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_messages_stream_with_a_tool(live):
    client = live.anthropic()
    tools = [{"name": "get_weather", "description": "Current weather of a city",
              "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Berlin?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "And Berlin?"}]},
    ]
    with client.messages.stream(model=live.model, max_tokens=6, messages=messages, tools=tools,
                                thinking={"type": "disabled"},
                                extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert final.usage.output_tokens >= 1 and final.stop_reason in ("max_tokens", "end_turn",
                                                                     "tool_use")

    # A prefilled tool call that the model ends at its first character: every printable
    # character is a stop sequence, so the call is all there is, and it streams as tool_use.
    stops = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\r", "\ufffd"]
    with client.messages.stream(
            model=live.model, max_tokens=6, tools=tools, stop_sequences=stops,
            extra_body={"temperature": 0},
            messages=messages + [{"role": "assistant", "content": TOOL_PREFILL}],
            thinking={"type": "disabled"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Berlin"} and block.id.startswith("toolu_")
    assert kinds.count("content_block_start") == 1 and "content_block_stop" in kinds


def test_responses_api_stream(live):
    client = live.openai()
    events = list(client.responses.create(model=live.model, input="Say hello.",
                                          instructions="Be brief.", max_output_tokens=6,
                                          reasoning={"effort": "none"}, stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens >= 1
    assert "response.output_item.added" in types and "response.output_item.done" in types

    # A conversation with a function call and its output, as codex sends it.
    reply = client.responses.create(model=live.model, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "List files."}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell",
         "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
    ], tools=[{"type": "function", "name": "shell", "parameters": {"type": "object"}}])
    assert reply.status in ("completed", "incomplete") and reply.usage.input_tokens > 10


def test_responses_api_stream_null_is_not_streamed(live):
    """`"stream": null` (some clients send every optional field, unset ones as null) is
    `"stream": false`: one JSON response, the same greedy answer as without the field."""
    body = {"model": live.model, "input": "Say hello.", "max_output_tokens": 6,
            "temperature": 0, "reasoning": {"effort": "none"}}
    plain = post(live, "/v1/responses", body)
    nulled = post(live, "/v1/responses", {**body, "stream": None})
    assert plain.status_code == 200, plain.text
    assert nulled.status_code == 200, nulled.text
    assert nulled.headers["content-type"].startswith("application/json")
    answer = nulled.json()
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
    def texts(reply: dict[str, Any]) -> list[str]:
        return [part["text"] for item in reply["output"] if item["type"] == "message"
                for part in item["content"]]

    assert texts(answer) == texts(plain.json()) and answer["usage"]["output_tokens"] >= 1


# ---------------------------------------------------------------- the prompt cache


def test_second_turn_reports_cached_tokens(live):
    client = live.openai()
    system = "You are a careful assistant who answers questions about cities. " * 30
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Where is the Eiffel Tower?"}]
    first = client.chat.completions.create(model=live.model, messages=messages, max_tokens=4,
                                           temperature=0, extra_body=NO_THINKING)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "And the Brandenburg Gate?"}]
    second = client.chat.completions.create(model=live.model, messages=messages, max_tokens=4,
                                            temperature=0, extra_body=NO_THINKING)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 8 and cached < second.usage.prompt_tokens

    with live.anthropic().messages.stream(
            model=live.model, max_tokens=4, system=system, thinking={"type": "disabled"},
            messages=[m for m in messages if m["role"] != "system"]) as stream:
        usage = stream.get_final_message().usage  # the counts arrive with message_delta
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == second.usage.prompt_tokens

    metrics = httpx.get(f"{live.url}/metrics").text
    restored = [line for line in metrics.splitlines()
                if line.startswith('rewind_cached_prompt_tokens_total{tier="ram"}')]
    assert float(restored[0].split()[-1]) >= cached
    ttft_count = [line for line in metrics.splitlines()
                  if line.startswith("rewind_time_to_first_token_seconds_count")]
    assert float(ttft_count[0].split()[-1]) >= 3


# ---------------------------------------------------------------- concurrency


def test_a_client_that_disconnects_frees_its_slot(live):
    wait_idle(live.engine)
    body = {"model": live.model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 3000, "stream": True, "temperature": 0,
            "logit_bias": never_stop(live.engine)}
    with httpx.Client(timeout=30) as raw:
        for _ in range(4):  # fill every slot, then hang up mid-stream
            with raw.stream("POST", f"{live.url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert len(sse_lines(lines, 3)) == 3  # generation is under way
    stats = wait_idle(live.engine)
    assert stats["finish_reasons"].get("cancelled", 0) >= 4
    client = live.openai()

    def short(i: int) -> int:
        reply = client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=4, temperature=0)
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(short, range(4))) == [4, 4, 4, 4]


def test_sixteen_concurrent_clients_at_parallel_four(live):
    client = live.openai()
    prompts = [f"Question number {i % 4}: what is {i % 4} plus {i % 4}?" for i in range(16)]

    def ask(prompt: str) -> tuple[str, int]:
        reply = client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": prompt}], max_tokens=6,
            temperature=0, extra_body=NO_THINKING)
        return reply.choices[0].message.content or "", reply.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    assert all(tokens >= 1 for _, tokens in answers)
    # Batched greedy decoding equals sequential greedy decoding, whatever shared the batch.
    for i in range(4):
        alone = ask(prompts[i])
        assert all(answers[j] == alone for j in range(i, 16, 4))


# ---------------------------------------------------------------- errors


def test_openai_errors(live):
    user = [{"role": "user", "content": "hi"}]
    chat = "/v1/chat/completions"
    assert "malformed JSON" in openai_error(post(live, chat, b'{"messages": ['), 400)["message"]
    assert openai_error(post(live, chat, {"messages": user, "temperature": "hot"}),
                        400)["param"] == "temperature"
    assert openai_error(post(live, chat, {"messages": "hi"}), 400)["param"].startswith("messages")
    missing = openai_error(post(live, chat, {"model": "gpt-17", "messages": user}), 404)
    assert missing["code"] == "model_not_found"
    assert openai_error(post(live, chat, {"messages": []}), 400)["param"] == "messages"
    long_prompt = [{"role": "user", "content": "word " * 5000}]
    too_long = openai_error(post(live, chat, {"messages": long_prompt}), 400)
    assert too_long["code"] == "context_length_exceeded" and "4096" in too_long["message"]
    assert openai_error(post(live, chat, {"messages": user, "n": 2}), 400)["param"] == "n"
    assert openai_error(post(live, chat, {"messages": user, "response_format": {
        "type": "json_schema", "json_schema": {}}}), 400)["param"] == "response_format"
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * BODY_LIMIT}]})
    assert "larger than" in openai_error(post(live, chat, huge), 413)["message"]
    assert openai_error(post(live, "/v1/completions", {"prompt": ""}), 400)["param"] == "prompt"
    assert openai_error(post(live, "/v1/responses", {"input": "hi",
                                                     "previous_response_id": "resp_1"}),
                        400)["param"] == "previous_response_id"
    assert openai_error(httpx.get(f"{live.url}/v1/nothing-here"), 404)
    # The typed client sees the same errors as exceptions.
    with pytest.raises(openai.NotFoundError):
        live.openai().chat.completions.create(model="gpt-17", messages=user)
    # None of that disturbed the server.
    reply = live.openai().chat.completions.create(model=live.model, messages=user, max_tokens=2,
                                                  temperature=0)
    assert reply.usage.completion_tokens == 2


def test_anthropic_errors(live):
    user = [{"role": "user", "content": "hi"}]
    messages = "/v1/messages"
    assert anthropic_error(post(live, messages, b"{nope"), 400)["type"] == "invalid_request_error"
    assert "max_tokens" in anthropic_error(post(live, messages, {"messages": user}),
                                           400)["message"]
    assert anthropic_error(post(live, messages, {"model": "claude-x", "max_tokens": 5,
                                                 "messages": user}), 404)["type"] == \
        "not_found_error"
    assert anthropic_error(post(live, messages, {"max_tokens": 5, "messages": []}), 400)
    long_prompt = [{"role": "user", "content": "word " * 5000}]
    assert "4096" in anthropic_error(post(live, messages, {"max_tokens": 5,
                                                           "messages": long_prompt}),
                                     400)["message"]
    huge = json.dumps({"max_tokens": 5, "messages": [{"role": "user",
                                                      "content": "x" * BODY_LIMIT}]})
    assert anthropic_error(post(live, messages, huge), 413)["type"] == "request_too_large"
    counted = post(live, "/v1/messages/count_tokens", {"messages": user})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 2
    with pytest.raises(anthropic.NotFoundError):
        live.anthropic().messages.create(model="claude-x", max_tokens=5, messages=user)


def test_output_tokens_are_capped_by_the_server(tiny_model_path, tmp_path):
    """--max-tokens: the length of an answer that names no limit (codex sends none), and the most
    any request gets (Claude Code asks for 32k; the tiny model holds 4,096 in all)."""
    with tiny_live_server(tiny_model_path("llama"), tmp_path, max_tokens=5) as capped:
        endless = never_stop(capped.engine)
        for asked in (None, 3, 5000, 32000):
            limit = {} if asked is None else {"max_tokens": asked}
            reply = capped.openai().completions.create(
                model=capped.model, prompt="Once", temperature=0, logit_bias=endless, **limit)
            assert reply.usage.completion_tokens == min(asked or 5, 5)
            assert reply.choices[0].finish_reason == "length"
        message = capped.anthropic().messages.create(
            model=capped.model, max_tokens=32000, messages=[{"role": "user", "content": "hi"}])
        assert message.usage.output_tokens <= 5
        answer = post(capped, "/v1/responses", {"input": "hi", "temperature": 0})
        assert answer.json()["usage"]["output_tokens"] <= 5


def test_api_key_is_required_when_set(live):
    config = ServerConfig(model=live.model, api_key="sk-secret")
    keyed = start_server(create_app(live.loaded, live.engine, config), live.engine, live.loaded)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert openai_error(post(keyed, "/v1/chat/completions", body), 401)["type"] == \
            "authentication_error"
        wrong = post(keyed, "/v1/chat/completions", body, headers={"authorization": "Bearer no"})
        assert "invalid" in openai_error(wrong, 401)["message"]
        assert anthropic_error(post(keyed, "/v1/messages", body), 401)["type"] == \
            "authentication_error"
        assert httpx.get(f"{keyed.url}/health").status_code == 200
        reply = keyed.openai(api_key="sk-secret").chat.completions.create(
            model=live.model, messages=body["messages"], max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens == 2
        message = keyed.anthropic(api_key="sk-secret").messages.create(  # sends x-api-key
            model=live.model, max_tokens=2, messages=body["messages"],
            extra_body={"temperature": 0})
        assert message.usage.output_tokens == 2
    finally:
        keyed.stop()


def test_a_full_queue_answers_429_with_retry_after(tiny_model_path):
    loaded = load_model(str(tiny_model_path("llama")))
    engine = Engine(loaded, EngineConfig(parallel=1, max_queue=1)).start()
    tight = start_server(create_app(loaded, engine, ServerConfig(model=str(loaded.name))),
                         engine, loaded)
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 3000,
            "stream": True, "logit_bias": never_stop(engine)}
    try:
        with httpx.Client(timeout=30) as raw:
            with raw.stream("POST", f"{tight.url}/v1/chat/completions", json=body) as running:
                lines = running.iter_lines()
                assert len(sse_lines(lines, 3)) == 3  # holds the only slot
                with raw.stream("POST", f"{tight.url}/v1/chat/completions",
                                json=body) as waiting:
                    assert waiting.status_code == 200  # queued
                    stats = engine.stats()
                    refused = post(tight, "/v1/chat/completions", body)
                    assert refused.status_code == 429, (stats, engine.stats(), refused.text[-300:])
                    assert openai_error(refused, 429)["code"] == "queue_full"
                    assert int(refused.headers["retry-after"]) >= 1
        wait_idle(engine)
    finally:
        tight.stop()
        engine.shutdown()


def test_keep_alives_while_waiting_are_skipped_by_clients(live, monkeypatch):
    from rewind.server import anthropic_api, openai_api

    monkeypatch.setattr(openai_api, "KEEPALIVE_SECONDS", 0.001)  # every wait is "long"
    monkeypatch.setattr(anthropic_api, "KEEPALIVE_SECONDS", 0.001)
    body = {"model": live.model, "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 5, "temperature": 0, "stream": True, **NO_THINKING}
    raw = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).text
    assert ": keep-alive" in raw and raw.rstrip().endswith("data: [DONE]")
    typed = {key: value for key, value in body.items() if key != "chat_template_kwargs"}
    chunks = list(live.openai().chat.completions.create(**typed, extra_body=NO_THINKING))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = live.openai().chat.completions.create(**{**typed, "stream": False},
                                                  extra_body=NO_THINKING)
    assert streamed == (plain.choices[0].message.content or "")
    with live.anthropic().messages.stream(
            model=live.model, max_tokens=5, messages=body["messages"],
            thinking={"type": "disabled"}, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "message_stop"


def test_logprobs(live):
    reply = live.openai().chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINKING)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy picks the most likely token, so it tops its own list.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)

    legacy = live.openai().completions.create(model=live.model, prompt="Once upon", max_tokens=3,
                                              temperature=0, logprobs=2).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 3
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in legacy.top_logprobs)
