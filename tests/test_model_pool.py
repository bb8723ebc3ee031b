"""Many models, one server: load on the first request that names a model, unload (LRU under a
budget, keep_alive, idle, by request), memory budget errors and fallbacks, the in-serving guard.
Real servers on loopback, the real openai / anthropic clients, tiny random models."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import post, tiny_live_server
from pool_server import metric, models_by_id, pool_server

FAMILIES = ("llama", "gemma3", "qwen3_5")
QUESTION = [{"role": "user", "content": "Say something about caches."}]
# 600 ids: two whole 256-token blocks, on the tiny models' 512-id vocabulary.
PROMPT = [(7 * i) % 500 + 3 for i in range(600)]


@pytest.fixture(autouse=True)
def own_catalog(tmp_path, monkeypatch):
    """Only what a test puts in its catalog: no real default model, no real hub cache."""
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def folders(tiny_model_path) -> list[str]:
    return [str(tiny_model_path(family)) for family in FAMILIES]


def chat(client: openai.OpenAI, model: str, **extra) -> str:
    """The whole answer: the tiny models' template opens a reasoning block."""
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                            temperature=0, **extra)
    message = answer.choices[0].message
    text = (message.model_extra or {}).get("reasoning_content", "") + (message.content or "")
    assert text
    return text


def alone(folder: str, scratch: Path) -> str:
    with tiny_live_server(Path(folder), scratch) as live:
        return chat(live.openai(), live.model)


def cached_tokens(live, model: str, **extra) -> int:
    answer = post(live, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2,
                                            "temperature": 0, **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_alternating_models_answer_as_each_alone(tiny_model_path, tmp_path):
    names = folders(tiny_model_path)
    expected = {name: alone(name, tmp_path / f"alone-{i}") for i, name in enumerate(names)}
    with pool_server(names, tmp_path / "pool") as (live, _):
        listed = models_by_id(live)
        assert [listed[name]["loaded"] for name in names] == [True, False, False]
        # The models named on the command line come first, in their order: a client that takes
        # the first listed model (agents' defaults, bench harnesses) gets the one served.
        assert list(listed)[:len(names)] == names
        assert all(listed[name]["form"] == "f32" and listed[name]["context_length"]
                   and listed[name]["size_bytes"] > 0 for name in names)
        client = live.openai()
        for _ in range(2):
            for name in names:
                assert chat(client, name) == expected[name], name
        # The Anthropic API reaches a model by its folder's name (an alias) too.
        reply = live.anthropic().messages.create(
            model=Path(names[1]).name, max_tokens=12, messages=QUESTION,
            extra_body={"temperature": 0})
        text = "".join(getattr(block, "thinking", "") or getattr(block, "text", "")
                       for block in reply.content)
        assert text == expected[names[1]]
        listed = models_by_id(live)
        assert all(listed[name]["loaded"] for name in names)
        assert not listed["default"]["loaded"]  # servable, converted on first use
        assert metric(live, "rewind_model_loads_total", model=names[2]) == 1

        with pytest.raises(openai.NotFoundError) as missing:
            chat(client, "no-such-model")
        message = missing.value.body["message"]
        assert "no-such-model" in message and all(name in message for name in names)


def test_a_budget_for_two_unloads_the_least_recently_used(tiny_model_path, tmp_path):
    names = folders(tiny_model_path)
    # KV reserves of 12 x 4096 tokens (52-200 MB of accounting, nothing allocated) keep the
    # needs well above what first loads and served requests add to the sampled baseline (up to
    # ~12 MB measured in a fresh process).
    with pool_server(names, tmp_path, reserve_tokens=4096, parallel=12) as (live, pool):
        needs = [pool.load_need_of(pool.slot(name).entry) for name in names]
        two = sorted(needs)[1:]
        pool.budget.total = pool.budget.baseline() + sum(two) + min(needs) * 3 // 4  # not 3
        first, second, third = names
        assert cached_tokens(live, first) == 0  # the first is loaded at start
        cached_tokens(live, second)
        cached_tokens(live, third)  # no room for three: the first goes
        state = models_by_id(live)
        assert [state[name]["loaded"] for name in names] == [False, True, True]
        assert metric(live, "rewind_model_unloads_total", model=first, reason="lru") == 1
        assert metric(live, "rewind_model_state", model=first, state="unloaded") == 1
        assert metric(live, "rewind_memory_guard_actions_total", action="unload_lru") == 1
        assert metric(live, "rewind_memory_bytes", part="committed") <= pool.budget.total
        # Reloaded, the first model finds the records its earlier requests left.
        assert cached_tokens(live, first) >= 512
        assert not models_by_id(live)[second]["loaded"]  # now the least recently used


def test_a_model_over_budget_is_a_clear_error_and_others_keep_serving(tiny_model_path,
                                                                      tmp_path):
    names = folders(tiny_model_path)
    gemma = names[1]
    with pool_server([gemma, names[0]], tmp_path, reserve_tokens=4096) as (live, pool):
        # Llama's KV reserve (4 full-attention layers) is the largest: it cannot fit alone.
        pool.budget.total = (pool.budget.baseline() + pool.load_need_of(pool.slot(gemma).entry)
                             + (1 << 20))
        assert pool.load_need_of(pool.slot(names[0]).entry) > pool.budget.alone_room()
        client = live.openai()
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, names[0])
        error = refused.value.body
        assert error["code"] == "insufficient_memory" and "GiB" in error["message"]
        assert "--memory-budget" in error["message"]
        assert chat(client, gemma)  # the loaded model keeps serving
        assert metric(live, "rewind_memory_guard_actions_total", action="refuse_load") == 1


# A llama of ~14M parameters: its f32 and bf16 forms differ by ~27 MB, well above the few MB an
# unload or a served request leaves in the sampled baseline (the tiny ones differ by 0.7 MB).
SMALL_LLAMA = {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 64}


def test_a_smaller_form_serves_when_the_named_one_does_not_fit(tiny_model_path, tmp_path):
    from rewind import paths
    from rewind.models.conversion import QuantSpec, convert
    from rewind.testing.tiny_models import build_tiny_model

    llama = str(build_tiny_model("llama", tmp_path / "small-llama", overrides=SMALL_LLAMA))
    gemma = str(tiny_model_path("gemma3"))
    convert(Path(llama), paths.models_dir() / "small-llama-bf16", QuantSpec(16),
            show_progress=False)
    with pool_server([gemma, llama], tmp_path, reserve_tokens=16) as (live, pool):
        full = pool.load_need_of(pool.slot(llama).entry)
        small = pool.load_need_of(pool.slot("small-llama-bf16").entry)
        assert small + (16 << 20) < full
        pool.budget.total = pool.budget.baseline() + (small + full) // 2
        answer = post(live, "/v1/chat/completions", {"model": llama, "messages": QUESTION,
                                                     "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        note = answer.headers["x-rewind-model-fallback"]
        assert note.startswith("small-llama-bf16 (bf16) served for") and llama in note
        assert models_by_id(live)["small-llama-bf16"]["loaded"]
        assert not models_by_id(live)[llama]["loaded"]


def test_keep_alive_idle_time_and_the_load_unload_endpoints(tiny_model_path, tmp_path):
    names = folders(tiny_model_path)[:2]
    with pool_server(names, tmp_path, idle_unload=0.5) as (live, pool):
        client = live.openai()
        chat(client, names[1], extra_body={"keep_alive": 0})  # Ollama's: unload right after
        deadline = time.monotonic() + 10
        while models_by_id(live)[names[1]]["loaded"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not models_by_id(live)[names[1]]["loaded"]
        assert metric(live, "rewind_model_unloads_total", model=names[1],
                      reason="keep_alive") == 1
        # The first model was not used for --idle-unload 0.5 s: it went too.
        deadline = time.monotonic() + 10
        while models_by_id(live)[names[0]]["loaded"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(live, "rewind_model_unloads_total", model=names[0], reason="idle") == 1

        loaded = post(live, "/v1/models/load", {"model": names[1], "keep_alive": "-1"})
        assert loaded.status_code == 200 and loaded.json()["loaded"], loaded.text
        time.sleep(1.0)  # -1: kept, whatever --idle-unload says
        assert models_by_id(live)[names[1]]["loaded"]
        unloaded = post(live, "/v1/models/unload", {"model": names[1]})
        assert unloaded.status_code == 200 and not unloaded.json()["loaded"], unloaded.text
        assert post(live, "/v1/models/load", {"model": "nope"}).status_code == 404
        bad = post(live, "/v1/chat/completions", {"model": names[0], "messages": QUESTION,
                                                  "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.text


def test_unload_waits_for_the_running_request(tiny_model_path, tmp_path):
    name = folders(tiny_model_path)[0]
    with pool_server([name], tmp_path) as (live, _):
        with concurrent.futures.ThreadPoolExecutor(2) as workers:
            running = workers.submit(post, live, "/v1/completions",
                                     {"model": name, "prompt": PROMPT, "max_tokens": 200,
                                      "temperature": 0})
            time.sleep(0.3)
            unloaded = post(live, "/v1/models/unload", {"model": name})
            answer = running.result()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert unloaded.status_code == 200 and not unloaded.json()["loaded"]


def test_a_sequence_that_would_cross_the_budget_ends_with_length(tiny_model_path, tmp_path):
    from rewind.models.memory_estimate import KV_STEP

    name = folders(tiny_model_path)[0]
    with pool_server([name], tmp_path, reserve_tokens=16) as (live, pool):
        # Only the model's reserve: --parallel 2 slots of 16 tokens (256, mlx-lm's step).
        pool.budget.total = pool.budget.baseline() + pool.budget.models_bytes()
        assert pool.slot(name).runtime.kv.bytes_for(2 * KV_STEP) == pool.budget.models_bytes() \
            - pool.slot(name).loaded_bytes
        prompt = PROMPT[:200]
        answer = post(live, "/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": "x " * 60}],
            "max_tokens": 1000, "temperature": 0})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert "memory budget" in choice["finish_detail"]
        assert answer.json()["usage"]["completion_tokens"] < 1000
        assert metric(live, "rewind_memory_guard_actions_total", action="cut_length") >= 1
        # The same cut through the Anthropic and Responses APIs: their "length" stop, and the
        # reason in a field of its own (the SDKs keep unknown fields).
        long_question = [{"role": "user", "content": "x " * 60}]
        message = post(live, "/v1/messages", {"model": name, "messages": long_question,
                                              "max_tokens": 1000, "temperature": 0}).json()
        assert message["stop_reason"] == "max_tokens", message
        assert "memory budget" in message["stop_detail"]
        response = post(live, "/v1/responses", {"model": name, "input": "x " * 60,
                                                "max_output_tokens": 1000,
                                                "temperature": 0}).json()
        assert response["status"] == "incomplete", response
        assert response["incomplete_details"]["reason"] == "max_output_tokens"
        assert "memory budget" in response["incomplete_details"]["detail"]
        # A prompt that can never fit is a 400 naming the need; the server goes on.
        too_long = post(live, "/v1/completions", {"model": name, "prompt": PROMPT * 2,
                                                  "max_tokens": 2})
        assert too_long.status_code == 400 and "memory budget" in too_long.text
        assert post(live, "/v1/completions", {"model": name, "prompt": prompt,
                                              "max_tokens": 2}).status_code == 200


def test_parallel_long_prompts_against_a_tight_budget(tiny_model_path, tmp_path):
    name = folders(tiny_model_path)[0]
    with pool_server([name], tmp_path, reserve_tokens=16, parallel=4) as (live, pool):
        pool.budget.max_waiting = 1  # the engine's queue (16) is not what answers 429 here
        kv = pool.slot(name).runtime.kv
        # Room for two long sequences beyond the model's reserve.
        pool.budget.total = pool.budget.baseline() + pool.budget.models_bytes() + kv.bytes_for(1024) * 2
        prompts = [[(13 * i + k) % 500 + 3 for i in range(900)] for k in range(8)]

        def send(prompt: list[int]) -> httpx.Response:
            return post(live, "/v1/completions", {"model": name, "prompt": prompt,
                                                  "max_tokens": 300, "temperature": 0})

        with concurrent.futures.ThreadPoolExecutor(8) as workers:
            answers = list(workers.map(send, prompts))
        statuses = sorted(answer.status_code for answer in answers)
        assert set(statuses) <= {200, 429}, [a.text for a in answers]
        assert 429 in statuses and 200 in statuses
        assert all(a.headers.get("retry-after") for a in answers if a.status_code == 429)
        finished = [a.json()["choices"][0]["finish_reason"] for a in answers
                    if a.status_code == 200]
        assert set(finished) <= {"length", "stop"}
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert metric(live, "rewind_memory_guard_actions_total", action="reject_429") >= 1
        assert pool.budget.live_bytes() == 0  # every ticket given back


IN_OWN_PROCESS = "REWIND_TEST_IN_OWN_PROCESS"


def test_rss_stays_under_the_budget_over_a_load_unload_churn(tiny_model_path, tmp_path):
    """What the OS sees, not what the accounting says: the process's RSS, sampled every 2 ms
    while 12 requests cycle through 4 models under a budget that fits the two largest (so each
    load first unloads the least recently used one).

    It runs in a process of its own: after hundreds of tests the pytest process's heap grows and
    shrinks on its own (freed arenas, other tests' threads winding down), which the budget counts
    as baseline, and 24 MiB of slack is not a bound on that. A server process has no such
    neighbours."""
    import os
    import subprocess
    import sys

    if os.environ.get(IN_OWN_PROCESS):
        churn_under_a_tight_budget(tiny_model_path, tmp_path)
        return
    env = dict(os.environ, **{IN_OWN_PROCESS: "1"})
    test = f"{Path(__file__).resolve()}::test_rss_stays_under_the_budget_over_a_load_unload_churn"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
         str(tmp_path / "child"), test],
        env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert "1 passed" in child.stdout, child.stdout[-2000:]


def churn_under_a_tight_budget(tiny_model_path, tmp_path) -> None:
    import threading

    from rewind import paths
    from rewind.memory import process_rss
    from rewind.models.conversion import QuantSpec, convert
    from rewind.testing.tiny_models import build_tiny_model

    big = str(build_tiny_model("llama", tmp_path / "small-llama", overrides=SMALL_LLAMA))
    convert(Path(big), paths.models_dir() / "small-llama-bf16", QuantSpec(16),
            show_progress=False)
    names = [str(tiny_model_path("gemma3")), big, "small-llama-bf16",
             str(tiny_model_path("llama"))]
    with pool_server(names, tmp_path, reserve_tokens=256) as (live, pool):
        needs = sorted(pool.load_need_of(pool.slot(name).entry) for name in names)
        # The two largest and 24 MiB for what first loads and serving add to the baseline (up
        # to ~12 MB measured in a fresh process).
        pool.budget.total = pool.budget.baseline() + needs[-1] + needs[-2] + (24 << 20)
        highest = [process_rss()]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                highest[0] = max(highest[0], process_rss())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            client = live.openai()
            for index in range(12):
                chat(client, names[(index + 1) % len(names)])
        finally:
            done.set()
            sampler.join()
        assert highest[0] <= pool.budget.total, (highest[0], pool.budget.total)
        unloads = sum(metric(live, "rewind_model_unloads_total", model=name, reason="lru")
                      for name in names)
        assert unloads >= 6  # the budget did force the churn
        assert metric(live, "rewind_process_rss_bytes") <= pool.budget.total


def test_a_wait_for_memory_is_bounded_and_ends_when_its_client_leaves(tiny_model_path,
                                                                      tmp_path):
    name = folders(tiny_model_path)[0]
    with pool_server([name], tmp_path, reserve_tokens=16) as (live, pool):
        budget = pool.budget
        budget.total = budget.baseline() + budget.models_bytes()  # the model's reserve only
        kv = pool.slot(name).runtime.kv
        # A running sequence holding the whole reserve (--parallel 2 x 256 tokens): a real
        # ticket, taken as a request's would be, so the wait does not hang on timing.
        held = budget.reserve(kv, 512, name)
        assert held is not None
        request = {"model": name, "prompt": PROMPT[:200], "max_tokens": 2, "temperature": 0}

        budget.max_wait_seconds = 0.3
        answer = post(live, "/v1/completions", request)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] and "memory budget" in answer.text
        assert metric(live, "rewind_memory_guard_actions_total", action="wait_timeout") == 1

        budget.max_wait_seconds = 600
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
            httpx.post(f"{live.url}/v1/completions", json=request, timeout=1.0)
        deadline = time.monotonic() + 30
        while budget.waiting and time.monotonic() < deadline:
            time.sleep(0.05)
        assert budget.waiting == 0
        assert metric(live, "rewind_memory_guard_actions_total", action="wait_abandoned") == 1

        held.release()
        assert post(live, "/v1/completions", request).status_code == 200
        assert budget.live_bytes() == 0
