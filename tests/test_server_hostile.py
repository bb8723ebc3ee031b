"""Input that once crashed the server or drew a 500 (issue 17's list), and what a hostile or broken
client does at the transport level, against a live server on loopback. Each answer must be a 4xx
in the API's own shape, the keep-alive connection must stay usable, and the server must still
answer correctly afterwards."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import Live, anthropic_error, openai_error, post, tiny_live_server

POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens"]
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(tiny_model_path, tmp_path_factory) -> Iterator[Live]:
    with tiny_live_server(tiny_model_path("llama"), tmp_path_factory.mktemp("scratch"),
                          body_idle_seconds=1.0) as server:
        yield server


def error_of(response: httpx.Response, path: str, status: int) -> dict[str, Any]:
    if path.startswith("/v1/messages"):
        return anthropic_error(response, status)
    return openai_error(response, status)


def still_answers(live: Live) -> None:
    reply = live.openai().completions.create(model=live.model, prompt="Once upon a time",
                                             max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2


@pytest.mark.parametrize("prompt", [[2, 1_000_000_000], [2, 2**70], [-1, 5], [2, -(2**70)]])
def test_token_ids_outside_the_vocabulary_are_a_400(live, prompt):
    error = openai_error(post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 4}), 400)
    assert "vocabulary" in error["message"]
    still_answers(live)


@pytest.mark.parametrize("path", POST_ROUTES)
def test_deeply_nested_json_is_a_400_on_every_route(live, path):
    deep = '{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}"
    assert "nests deeper" in error_of(post(live, path, deep), path, 400)["message"]
    moderately = {"messages": USER, "max_tokens": 2, "input": "hi", "prompt": "hi",
                  "metadata": json.loads('{"a": ' * 100 + "1" + "}" * 100)}
    assert "nests deeper" in error_of(post(live, path, moderately), path, 400)["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("/v1/completions", '{"prompt": "\\udfff"}'),
    ("/v1/responses", '{"input": "x\\uDBFFy"}'),
    ("/v1/messages", '{"max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/messages/count_tokens", '{"messages": [{"role": "user", "content": "ok"}], '
     '"system": "\\ud83d"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"metadata": {"\\ud800": 1}}'),
])
def test_lone_surrogates_are_a_400(live, path, body):
    assert "surrogate" in error_of(post(live, path, body), path, 400)["message"]
    # A proper pair is text like any other.
    paired = body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00")
    if paired != body and "metadata" not in body:
        assert post(live, path, paired).status_code == 200


@pytest.mark.parametrize("seed", [2**64, 1e30, -1e30, -2])
def test_seeds_out_of_range_are_a_400(live, seed):
    body = {"prompt": "Once", "max_tokens": 2, "seed": seed}
    assert openai_error(post(live, "/v1/completions", body), 400)["param"] == "seed"


def test_seed_minus_one_means_a_random_seed(live):
    body = {"prompt": "Once", "max_tokens": 2, "seed": -1, "temperature": 1.0}
    assert post(live, "/v1/completions", body).status_code == 200
    body["seed"] = 2**64 - 1
    assert post(live, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_non_finite_numbers_are_a_400(live, raw):
    body = ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
            f'"logit_bias": {{"5": {raw}}}}}')
    assert "JSON" in openai_error(post(live, "/v1/chat/completions", body), 400)["message"] or \
        "large" in openai_error(post(live, "/v1/chat/completions", body), 400)["message"]
    temperature = f'{{"prompt": "hi", "temperature": {raw}}}'
    openai_error(post(live, "/v1/completions", temperature), 400)


def strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in a response: not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("bias", [100, -100])
def test_extreme_logit_bias_with_logprobs_gives_strict_json(live, bias):
    body = {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 5,
            "logit_bias": {"5": bias, "6": -bias}}
    plain = post(live, "/v1/chat/completions", body)
    assert plain.status_code == 200
    entries = strict_json(plain.text)["choices"][0]["logprobs"]["content"]
    assert all(-9999.0 <= e["logprob"] <= 0 for e in entries)
    streamed = post(live, "/v1/chat/completions", {**body, "stream": True})
    assert streamed.status_code == 200
    for line in streamed.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            strict_json(line[len("data: "):])
    beyond = post(live, "/v1/chat/completions", {**body, "logit_bias": {"5": 101}})
    assert openai_error(beyond, 400)["param"].startswith("logit_bias")


@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": False}, {"messages": []},
                                    {"tokenize": True}, {"tools": []}])
def test_chat_template_kwargs_cannot_set_what_the_server_sets(live, kwargs):
    body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": kwargs}
    error = openai_error(post(live, "/v1/chat/completions", body), 400)
    assert error["param"] == "chat_template_kwargs" and next(iter(kwargs)) in error["message"]


def _responses_call(arguments: Any) -> dict[str, Any]:
    return {"max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}


@pytest.mark.parametrize("arguments", [5, 1.5, True, [1], "[1, 2]", "7"])
def test_responses_function_call_arguments_that_are_no_object_are_a_400(live, arguments):
    error = openai_error(post(live, "/v1/responses", _responses_call(arguments)), 400)
    assert "arguments" in error["message"] and error["param"].startswith("input")


def test_responses_function_call_arguments_may_be_an_object(live):
    as_object = post(live, "/v1/responses", _responses_call({"city": "Paris"}))
    as_string = post(live, "/v1/responses", _responses_call('{"city": "Paris"}'))
    assert as_object.status_code == as_string.status_code == 200
    assert as_object.json()["usage"]["input_tokens"] == as_string.json()["usage"]["input_tokens"]


def test_a_connection_stays_usable_after_errors(live):
    """Every error answer leaves the keep-alive connection open for the next request."""
    with httpx.Client(base_url=live.url, timeout=30) as client:
        for body in (b'{"prompt": [2, 1000000000]}', b"[" * 5000, b'{"prompt": "\\ud800"}',
                     b'{"prompt": "hi", "seed": -5}', b"{"):
            answer = client.post("/v1/completions", content=body,
                                 headers={"content-type": "application/json"})
            assert 400 <= answer.status_code < 500
            assert answer.headers.get("connection") != "close"
        ok = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200


def test_405_names_the_allowed_methods(live):
    answer = httpx.get(f"{live.url}/v1/chat/completions")
    openai_error(answer, 405)
    assert answer.headers["allow"] == "POST"


def _raw_request(live: Live, head: bytes, body: bytes) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head + body)
    return sock


def _http_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _metric(live: Live, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{live.url}/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_stalled_body_is_timed_out_with_a_408(live):
    started = time.monotonic()
    sock = _raw_request(live, _http_head("/v1/completions", 100), b'{"prompt": ')
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 8  # the idle limit is 1 s here; 30 s by default
    still_answers(live)


def test_a_client_that_drops_mid_body_is_no_server_error(live):
    errors_500 = _metric(live, 'rewind_http_errors_total{status="500"}')
    sock = _raw_request(live, _http_head("/v1/chat/completions", 1000), b'{"messages": [')
    time.sleep(0.2)
    sock.close()
    deadline = time.monotonic() + 5
    while _metric(live, 'rewind_http_errors_total{status="499"}') < 1:
        assert time.monotonic() < deadline, "the dropped body was never counted"
        time.sleep(0.05)
    assert _metric(live, 'rewind_http_errors_total{status="500"}') == errors_500
    still_answers(live)


def test_openapi_declares_every_request_body(live):
    document = httpx.get(f"{live.url}/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path in POST_ROUTES:
        body = document["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert name in schemas, (path, name)
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "messages" in chat["properties"]
    # Every $ref in the document resolves.
    refs = [part.split('"')[0] for part in json.dumps(document).split('"$ref": "#/')[1:]]
    for ref in refs:
        node: Any = document
        for key in ref.split("/"):
            node = node[key]
