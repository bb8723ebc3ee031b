"""An engine whose forward pass raises, inside a real `rewind serve` serving two models, driven by
the real `openai` and `anthropic` clients: the requests in that engine end at once with an error
in their API's own shape (streaming or not), the other model's requests are served meanwhile, and
the engine is restarted with its model, so the next request gets the same answer as before, in
the same process. The fault is REWIND_TEST_FORWARD_FAULT (rewind.engine.faults): a trigger file
that makes the named model's next forward pass raise."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rewind.bench.harness import ServerProcess, free_port

WAIT = 60  # seconds any one wait may take before the test fails (nothing may hang)
LONG = 3000  # output tokens asked of a request that must still run when the fault fires
# Prompts the tiny llama answers greedily for 400 tokens without an end-of-turn token (so a
# request asking for LONG is still running when the fault fires).
STILL_RUNNING = ("The weather in Berlin", "Tell me a story.", "The quick brown fox")
REFERENCE = [(13 * i) % 500 + 3 for i in range(300)]  # token ids: a prompt of two chunks


@dataclass
class Served:
    server: ServerProcess
    failing: str  # the model whose engine the tests fault (the tiny llama)
    other: str  # a model served beside it (the tiny gemma 3)
    trigger: Path

    @property
    def url(self) -> str:
        return self.server.base_url

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=WAIT,
                             max_retries=0)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="unused", timeout=WAIT,
                                   max_retries=0)

    def fault(self) -> None:
        """The failing model's next forward pass raises (the file is written whole first)."""
        part = self.trigger.with_name(self.trigger.name + ".part")
        part.write_text(self.failing)
        os.replace(part, self.trigger)

    def wait_fired(self) -> None:
        deadline = time.monotonic() + WAIT
        while self.trigger.exists():
            assert time.monotonic() < deadline, "the fault never fired"
            time.sleep(0.01)

    def model(self, name: str) -> dict[str, Any]:
        listed = httpx.get(f"{self.url}/v1/models", timeout=WAIT).json()["data"]
        return next(entry for entry in listed if entry["id"] == name)

    def metric(self, name: str, model: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=WAIT).text
        head = f'{name}{{model="{model}"}} '
        return next(float(line[len(head):]) for line in text.splitlines()
                    if line.startswith(head))

    def greedy(self, model: str) -> list[str]:
        """The failing model's greedy answer to REFERENCE, token by token."""
        answer = self.openai().completions.create(model=model, prompt=REFERENCE, max_tokens=8,
                                                  temperature=0, logprobs=0)
        return answer.choices[0].logprobs.tokens

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + WAIT
        while httpx.get(f"{self.url}/health", timeout=WAIT).status_code != 200:
            assert time.monotonic() < deadline, "the server never became healthy again"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tiny_model_path, tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("engine-failure")
    failing, other = str(tiny_model_path("llama")), str(tiny_model_path("gemma3"))
    trigger = root / "fault"
    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", failing, "--model", other,
            "--port", str(port), "--parallel", "4", "--cache-dir", str(root / "cache"),
            "--log-level", "warning"]
    server = ServerProcess("rewind", argv, port, root / "serve.log",
                           env={"REWIND_TEST_FORWARD_FAULT": str(trigger)},
                           ready_paths=("/health",)).start()
    try:
        server.wait_ready(120)
        yield Served(server, failing, other, trigger)
    finally:
        server.stop()


@dataclass
class Call:
    """One client call on a thread: `started` is set once it runs in the engine (a stream's
    first piece of text), then its outcome is `result` or `error`."""

    run: Callable[[Call], Any]
    started: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Call:
        def body() -> None:
            try:
                self.result = self.run(self)
            except BaseException as error:  # noqa: BLE001 - what the test checks
                self.error = error
            finally:
                self.started.set()

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()
        return self

    def join(self) -> Call:
        assert self.thread is not None
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "a client still waits"
        return self


def chat_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_streams_in_a_failing_engine_end_with_their_apis_error_and_it_restarts(served):
    client, claude = served.openai(), served.anthropic()
    before = served.greedy(served.failing)
    restarts = served.metric("rewind_engine_restarts_total", served.failing)

    def openai_stream(call: Call) -> Any:
        stream = client.chat.completions.create(
            model=served.failing, messages=chat_messages(STILL_RUNNING[0]), max_tokens=LONG,
            temperature=0, stream=True)
        chunks = 0
        for chunk in stream:
            chunks += 1
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and (delta.content or delta.model_extra.get("reasoning_content")):
                call.started.set()
        return chunks

    def anthropic_stream(call: Call) -> Any:
        events = []
        with claude.messages.stream(model=served.failing, max_tokens=LONG,
                                    messages=chat_messages(STILL_RUNNING[1]),
                                    extra_body={"temperature": 0}) as stream:
            for event in stream:
                events.append(event.type)
                if event.type == "content_block_delta":
                    call.started.set()
        return events

    def responses_stream(call: Call) -> Any:
        events = []
        for event in client.responses.create(model=served.failing, input=STILL_RUNNING[2],
                                             max_output_tokens=LONG, temperature=0,
                                             stream=True):
            events.append(event)
            if event.type.endswith(".delta"):
                call.started.set()
        return events

    def other_model_stream(call: Call) -> Any:
        call.started.set()
        finish = None
        for chunk in client.chat.completions.create(
                model=served.other, messages=chat_messages("hello world"), max_tokens=200,
                temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish

    failing = [Call(run).start() for run in (openai_stream, anthropic_stream, responses_stream)]
    for call in failing:
        assert call.started.wait(WAIT) and call.error is None, call.error
    other = Call(other_model_stream).start()
    served.fault()
    served.wait_fired()
    openai_call, anthropic_call, responses_call = (call.join() for call in failing)

    error = openai_call.error
    assert isinstance(error, openai.APIError), error
    assert error.body["type"] == "server_error" and "engine failure: InjectedFault" in error.message
    error = anthropic_call.error
    assert isinstance(error, anthropic.APIStatusError), error
    assert error.body == {"type": "error", "error": {"type": "api_error",
                                                     "message": error.body["error"]["message"]}}
    assert "engine failure: InjectedFault" in error.body["error"]["message"]
    assert responses_call.error is None, responses_call.error
    last = responses_call.result[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error"
    assert "engine failure: InjectedFault" in last.response.error.message

    assert other.join().error is None and other.result in ("length", "stop")
    # The next request restarts the engine with its model, if the pool has not yet.
    assert served.greedy(served.failing) == before
    served.wait_healthy()
    assert served.metric("rewind_engine_restarts_total", served.failing) == restarts + 1
    assert served.model(served.failing)["state"] == "loaded"


def test_requests_in_a_failing_engine_get_a_500_in_their_apis_shape_and_it_restarts(served):
    client, claude = served.openai(), served.anthropic()
    before = served.greedy(served.failing)
    loads = served.metric("rewind_model_loads_total", served.failing)
    calls = [
        Call(lambda call: client.chat.completions.create(
            model=served.failing, messages=chat_messages(STILL_RUNNING[0]), max_tokens=LONG,
            temperature=0)),
        Call(lambda call: claude.messages.create(
            model=served.failing, max_tokens=LONG, messages=chat_messages(STILL_RUNNING[1]),
            extra_body={"temperature": 0})),
        Call(lambda call: client.responses.create(
            model=served.failing, input=STILL_RUNNING[2], max_output_tokens=LONG,
            temperature=0)),
    ]
    for call in calls:
        call.start()
    deadline = time.monotonic() + WAIT
    while served.model(served.failing)["running"] < len(calls):  # all three hold the model
        assert time.monotonic() < deadline, "the requests never ran"
        time.sleep(0.01)
    other = Call(lambda call: client.chat.completions.create(
        model=served.other, messages=chat_messages("hello world"), max_tokens=100,
        temperature=0)).start()
    served.fault()
    served.wait_fired()
    chat_call, messages_call, responses_call = (call.join() for call in calls)

    for call in (chat_call, responses_call):
        error = call.error
        assert isinstance(error, openai.InternalServerError), error
        assert error.status_code == 500
        assert set(error.body) == {"message", "type", "param", "code"}
        assert error.body["type"] == "server_error"
        assert "engine failure: InjectedFault" in error.body["message"]
    error = messages_call.error
    assert isinstance(error, anthropic.InternalServerError), error
    assert error.body["type"] == "error" and error.body["error"]["type"] == "api_error"
    assert "engine failure: InjectedFault" in error.body["error"]["message"]

    assert other.join().error is None
    assert other.result.choices[0].finish_reason in ("length", "stop")
    assert served.greedy(served.failing) == before
    served.wait_healthy()
    # Restarted with its model: loaded once more, in the same process.
    assert served.metric("rewind_model_loads_total", served.failing) == loads + 1
    assert served.server.process.poll() is None


def test_a_caller_owned_engine_is_restarted_in_place(tiny_model_path, tmp_path, monkeypatch):
    """create_app(loaded, engine) serves an engine its caller owns, which the pool never
    unloads: a failure restarts that engine over the same model (Engine.restart)."""
    from live_server import tiny_live_server

    trigger = tmp_path / "fault"
    monkeypatch.setenv("REWIND_TEST_FORWARD_FAULT", str(trigger))
    with tiny_live_server(tiny_model_path("llama"), tmp_path / "cache") as live:
        client = live.openai()

        def greedy() -> list[str]:
            answer = client.completions.create(model=live.model, prompt=REFERENCE,
                                               max_tokens=8, temperature=0, logprobs=0)
            return answer.choices[0].logprobs.tokens

        before = greedy()
        stream = client.chat.completions.create(
            model=live.model, messages=chat_messages(STILL_RUNNING[0]), max_tokens=LONG,
            temperature=0, stream=True)
        with pytest.raises(openai.APIError, match="engine failure: InjectedFault"):
            for number, _ in enumerate(stream):
                if number == 2:
                    trigger.write_text(live.model)
        assert greedy() == before
        assert live.engine.restarts == 1 and live.engine.failure is None
