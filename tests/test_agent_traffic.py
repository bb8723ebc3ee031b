"""What coding agents send that other clients do not, through the real `anthropic` client against
a live server: Claude Code 2.1's system-role message inside `messages`, its billing-header system
block whose `cch` changes on every request, `cache_control`, `metadata.user_id`,
`context_management`, `output_config.effort`, adaptive thinking, and cache figures read from
`message_start`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from live_server import Live, post, tiny_live_server

SYSTEM_TEXT = ("You are Claude Code, an interactive CLI tool that helps users with software "
               "engineering tasks. Use the tools available to you. ") * 12


def billing_block(cch: str) -> dict[str, Any]:
    return {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.a1b; "
            f"cc_entrypoint=cli; cch={cch};"}


def claude_code_body(cch: str, question: str) -> dict[str, Any]:
    return {
        "max_tokens": 32000, "stream": True,
        "system": [billing_block(cch),
                   {"type": "text", "text": SYSTEM_TEXT, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": "<env>Working directory: /work/project\nPlatform: "
             "linux</env>"},
            {"role": "user", "content": [{"type": "text", "text": question,
                                          "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": "user_abc_account_123_session_456"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "thinking": {"type": "adaptive"},
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def live(tiny_model_path, tmp_path_factory) -> Iterator[Live]:
    with tiny_live_server(tiny_model_path("llama"), tmp_path_factory.mktemp("scratch"),
                          max_tokens=4) as server:
        yield server


def stream_usage(live: Live, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(message_start usage, message_delta usage) of a streamed request, through the client."""
    client = live.anthropic()
    # What this client version has no argument for goes as it would on the wire.
    loose = ("context_management", "output_config", "temperature")
    fields = {k: v for k, v in body.items() if k != "stream" and k not in loose}
    extra = {k: body[k] for k in loose if k in body}
    start = delta = None
    with client.messages.stream(model=live.model, **fields, extra_body=extra) as stream:
        for event in stream:
            if event.type == "message_start":
                start = event.message.usage.model_dump()
            elif event.type == "message_delta":
                delta = event.usage.model_dump()
    assert start is not None and delta is not None
    return start, delta


def test_claude_code_requests_are_accepted_and_hit_the_cache(live):
    first_start, _ = stream_usage(live, claude_code_body("a1b2c", "List the files."))
    assert first_start["cache_read_input_tokens"] == 0
    # The next request: another cch, the same conversation one turn longer.
    start, delta = stream_usage(live, claude_code_body("f9e8d", "List the files."))
    prompt = start["input_tokens"] + start["cache_read_input_tokens"]
    assert start["cache_read_input_tokens"] >= 0.9 * prompt, start
    assert delta["cache_read_input_tokens"] == start["cache_read_input_tokens"]
    assert delta["input_tokens"] == start["input_tokens"]


def count(live: Live, body: dict[str, Any]) -> int:
    fields = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "temperature")}
    answer = post(live, "/v1/messages/count_tokens", fields)
    assert answer.status_code == 200, answer.text
    return answer.json()["input_tokens"]


def test_billing_header_and_system_messages_are_placed_as_content(live):
    body = claude_code_body("a1b2c", "Hello")
    as_sent = count(live, body)
    assert count(live, {**body, "system": body["system"][1:]}) == as_sent  # header: not prompt
    # The leading system-role message joins the system prompt.
    env = body["messages"][0]["content"]
    merged = {**body, "system": SYSTEM_TEXT + "\n\n" + env, "messages": body["messages"][1:]}
    assert count(live, merged) == as_sent


def test_system_messages_anywhere_join_the_system_prompt(live):
    """Claude Code sends [user prompt, system environment block] and rewrites that user message
    when it retries: as part of the system prompt, the block stays in the cached prefix."""
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                {"role": "system", "content": "<reminder>be brief</reminder>"},
                {"role": "user", "content": "three"}]
    hoisted = {"system": "<reminder>be brief</reminder>",
               "messages": [m for m in messages if m["role"] != "system"]}
    assert count(live, {"messages": messages}) == count(live, hoisted)
    reply = live.anthropic().messages.create(model=live.model, max_tokens=3, messages=messages)
    assert reply.usage.output_tokens >= 1


@pytest.mark.parametrize("effort,thinking", [("low", "disabled"), ("high", "enabled")])
def test_effort_sets_the_reasoning_switch_when_thinking_does_not(live, effort, thinking):
    base = {"messages": [{"role": "user", "content": "Hi"}]}
    by_effort = count(live, {**base, "output_config": {"effort": effort}})
    by_thinking = count(live, {**base, "thinking": {"type": thinking, "budget_tokens": 1024}})
    assert by_effort == by_thinking
    adaptive = count(live, {**base, "thinking": {"type": "adaptive"}})
    assert adaptive == count(live, {**base, "thinking": {"type": "enabled",
                                                          "budget_tokens": 1024}})
