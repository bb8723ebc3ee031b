"""The continuous-batching engine on tiny random-weight models of every cache family."""

from __future__ import annotations

import asyncio
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rewind.config import EngineConfig
from rewind.engine import (
    Engine,
    EngineStoppedError,
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
)

TIMEOUT = 120  # seconds any one wait for the engine may take before the test fails

PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 8,  # past gemma3's 64-token window
    "a",
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n" * 14,  # > 256 tokens: several chunks
    "The weather in Berlin",
]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def no_eos(loaded) -> dict[int, float]:
    """A logit bias that keeps a random model from ever ending by itself."""
    return {int(t): -1e9 for t in Engine(loaded).eos_token_ids}


def reference_greedy(loaded, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """Plain batch-1 greedy decoding, written independently of the engine."""
    model = loaded.model
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out: list[int] = []
    while True:
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        if token in eos or len(out) >= max_tokens:
            return out
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]


def test_batched_greedy_equals_sequential_greedy(tiny_loaded, tiny_family):
    """Sequences join the batch while others decode (one prefill chunk per step) and leave at
    different steps (different max_tokens); each must match plain batch-1 greedy decoding."""
    loaded = tiny_loaded(tiny_family)
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    assert max(len(p) for p in prompts) > 256
    lengths = [20, 9, 14, 17, 5]
    eos = Engine(loaded).eos_token_ids
    with Engine(loaded, EngineConfig(parallel=4, prefill_chunk=256)) as engine:
        handles = [engine.submit(GenerationRequest(p, greedy(n))) for p, n in zip(prompts, lengths)]
        batched = [h.collect(TIMEOUT) for h in handles]
    for prompt, n, result in zip(prompts, lengths, batched):
        assert result.tokens == reference_greedy(loaded, prompt, n, eos)
        assert result.finish.reason == ("stop" if result.tokens[-1] in eos else "length")
        assert result.finish.usage.completion_tokens == len(result.tokens)
        assert result.finish.usage.prompt_tokens == len(prompt)
    # The sequences really were different, so equality above means something.
    assert len({tuple(r.tokens[:5]) for r in batched}) == len(prompts)


def test_sixteen_concurrent_requests_at_parallel_four_all_complete(tiny_loaded):
    loaded = tiny_loaded("llama")
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS[:4]] * 4
    params = greedy(max_tokens=16, logit_bias=no_eos(loaded))
    with Engine(loaded, EngineConfig(parallel=4)) as engine:
        handles = [engine.submit(GenerationRequest(p, params)) for p in prompts]
        results = [h.collect(TIMEOUT) for h in handles]
        stats = engine.stats()
    assert [r.finish.reason for r in results] == ["length"] * 16
    assert all(len(r.tokens) == 16 for r in results)
    # The same prompt gives the same tokens whichever batch neighbours it had.
    for i in range(4):
        assert {tuple(results[i + 4 * k].tokens) for k in range(4)} == {tuple(results[i].tokens)}
    assert stats["requests_finished"] == 16 and stats["running"] == 0 and stats["queued"] == 0
    assert stats["generated_tokens"] == 16 * 16
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts)


def test_cancel_frees_the_slot_and_its_memory(tiny_loaded):
    loaded = tiny_loaded("llama")
    long_prompt = loaded.tokenizer.encode(PROMPTS[3] * 3)  # ~1.5k tokens: ~1.5 MB of K/V
    prompt = loaded.tokenizer.encode("hello world")
    endless = greedy(max_tokens=100_000, logit_bias=no_eos(loaded))
    kv_bytes = len(long_prompt) * 4 * 2 * 2 * 16 * 4  # tokens x layers x (k, v) x heads x dim x f32
    with Engine(loaded, EngineConfig(parallel=1)) as engine:
        baseline = engine.stats()["mlx_active_bytes"]
        first = engine.submit(GenerationRequest(long_prompt, endless))
        events = first.events(TIMEOUT)
        assert isinstance(next(events), TokenEvent)  # it holds the only slot now
        holding = engine.stats()["mlx_active_bytes"]
        waiting = engine.submit(GenerationRequest(prompt, greedy(max_tokens=5)))
        assert engine.stats()["queued"] == 1
        first.cancel()
        finish = [e for e in events if isinstance(e, FinishEvent)][0]
        assert finish.reason == "cancelled"
        done = waiting.collect(TIMEOUT)
        assert done.finish.reason in ("length", "stop") and done.tokens
        # A finish event reaches its reader before the engine thread has released the slot
        # (on a loaded machine the reader reads first): wait for the release, with a deadline.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                engine.stats()["running"]
                or engine.stats()["mlx_active_bytes"] - baseline >= kv_bytes // 4):
            time.sleep(0.01)
        stats = engine.stats()
    assert stats["running"] == 0 and stats["finish_reasons"]["cancelled"] == 1
    assert holding - baseline >= kv_bytes
    assert stats["mlx_active_bytes"] - baseline < kv_bytes // 4


def test_an_idle_engine_hands_its_freed_memory_back(tiny_loaded):
    """Once the last request is done, MLX's buffer cache is emptied (and glibc's free heap
    trimmed): a burst of long prompts does not stay resident after it."""
    import time

    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode(PROMPTS[3] * 3)
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        handles = [engine.submit(GenerationRequest(prompt, greedy(max_tokens=8))) for _ in range(2)]
        [h.collect(TIMEOUT) for h in handles]
        deadline = time.monotonic() + 10
        while engine.stats()["mlx_cache_bytes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["mlx_cache_bytes"] == 0


def test_queue_full_raises(tiny_loaded):
    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode("hello")
    endless = greedy(max_tokens=100_000, logit_bias=no_eos(loaded))
    with Engine(loaded, EngineConfig(parallel=1, max_queue=2)) as engine:
        running = engine.submit(GenerationRequest(prompt, endless))
        next(running.events(TIMEOUT))  # admitted: the queue is empty again
        queued = [engine.submit(GenerationRequest(prompt, endless)) for _ in range(2)]
        with pytest.raises(QueueFullError) as raised:
            engine.submit(GenerationRequest(prompt, endless))
        assert raised.value.max_queue == 2
        assert 1.0 <= raised.value.retry_after_seconds <= 60.0
        assert engine.stats()["queued"] == 2
        for handle in [running, *queued]:
            handle.cancel()
        reasons = [h.collect(TIMEOUT).finish.reason for h in [running, *queued]]
    assert reasons == ["cancelled"] * 3


def test_stop_string_across_token_boundaries(tiny_loaded):
    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode("The quick brown fox")
    params = greedy(max_tokens=40, logit_bias=no_eos(loaded))
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        plain = engine.generate(GenerationRequest(prompt, params), TIMEOUT)
        # Per-token texts: pick a stop string made of the end of one token and the start of the
        # next, printable, first occurring there.
        texts = [loaded.tokenizer.decode([t]) for t in plain.tokens]
        offsets = [len("".join(texts[:i])) for i in range(len(texts) + 1)]
        stop = None
        for i in range(3, len(texts) - 1):
            candidate = texts[i][-2:] + texts[i + 1][:2]
            if (len(texts[i]) >= 2 and len(texts[i + 1]) >= 2 and candidate.isprintable()
                    and plain.text.find(candidate) == offsets[i + 1] - 2):
                stop = candidate
                break
        assert stop is not None, f"no usable boundary in {texts!r}"
        stopped = engine.generate(GenerationRequest(prompt, greedy(
            max_tokens=40, logit_bias=no_eos(loaded), stop=["never-there", stop])), TIMEOUT)
    assert stopped.finish.reason == "stop"
    assert stopped.finish.stop_string == stop
    assert stopped.text == plain.text[: plain.text.find(stop)]
    assert stopped.tokens == plain.tokens[: len(stopped.tokens)]


def test_seeded_sampling_is_reproducible(tiny_loaded):
    loaded = tiny_loaded("gemma3")
    prompt = loaded.tokenizer.encode("Once upon a time")

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=100, seed=seed,
                                max_tokens=20, logit_bias=no_eos(loaded))
        return engine.generate(GenerationRequest(prompt, params), TIMEOUT).tokens

    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        assert sample(7) == sample(7)
        assert sample(7) != sample(8)


def test_logprobs_are_sane(tiny_loaded):
    loaded = tiny_loaded("qwen3_5")
    prompt = loaded.tokenizer.encode("The weather in Berlin")
    with Engine(loaded) as engine:
        handle = engine.submit(GenerationRequest(prompt, greedy(
            max_tokens=8, logprobs=True, top_logprobs=5)))
        events = [e for e in handle.events(TIMEOUT) if isinstance(e, TokenEvent)]
    assert len(events) >= 1
    for event in events:
        assert event.logprob is not None and event.logprob <= 0.0
        top = event.top_logprobs
        assert top is not None and len(top) == 5
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == event.token  # greedy picks the most likely token
        assert top[0][1] == pytest.approx(event.logprob, abs=1e-5)
        assert sum(mx.exp(mx.array([lp for _, lp in top])).tolist()) <= 1.0 + 1e-5


def test_async_iteration(tiny_loaded):
    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode("hello world")

    async def consume(engine: Engine) -> list:
        handle = engine.submit(GenerationRequest(prompt, greedy(max_tokens=6)))
        return [event async for event in handle]

    with Engine(loaded) as engine:
        events = asyncio.run(asyncio.wait_for(consume(engine), TIMEOUT))
        expected = engine.generate(GenerationRequest(prompt, greedy(max_tokens=6)), TIMEOUT)
    assert isinstance(events[-1], FinishEvent)
    assert [e.token for e in events[:-1]] == expected.tokens


def test_a_failing_request_does_not_disturb_the_engine(tiny_loaded):
    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode("hello world")
    with Engine(loaded) as engine:
        def embed(start: int, end: int):  # called on the engine thread, for each chunk
            raise RuntimeError("the image tower failed")

        broken = engine.submit(GenerationRequest(prompt, greedy(), embed=embed))
        finish = broken.collect(TIMEOUT).finish
        assert finish.reason == "error" and "image tower" in finish.error
        healthy = engine.generate(GenerationRequest(prompt, greedy(max_tokens=4)), TIMEOUT)
        assert healthy.finish.reason in ("length", "stop") and healthy.tokens
        with pytest.raises(InvalidRequestError):
            engine.submit(GenerationRequest([], greedy()))
        with pytest.raises(InvalidRequestError):
            engine.submit(GenerationRequest(prompt, greedy(logit_bias={10**9: 1.0})))
        for ids in (["not", "ids"], [1, 10**9], [-1], [2**70]):  # never reach the kernels
            with pytest.raises(InvalidRequestError):
                engine.submit(GenerationRequest(ids, greedy()))


def test_penalties_and_bias_reach_the_model_output(tiny_loaded):
    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode("hello world")
    with Engine(loaded, EngineConfig(parallel=3)) as engine:
        handles = [engine.submit(GenerationRequest(prompt, params)) for params in (
            greedy(max_tokens=30, logit_bias=no_eos(loaded)),
            greedy(max_tokens=30, logit_bias=no_eos(loaded), presence_penalty=1e4),
            greedy(max_tokens=5, logit_bias={**no_eos(loaded), 42: 1e4}),
        )]
        plain, penalised, biased = (h.collect(TIMEOUT).tokens for h in handles)
    assert len(set(plain)) < len(plain)  # the random model repeats itself...
    assert len(set(penalised)) == len(penalised)  # ...unless every reuse costs 1e4
    assert biased == [42] * 5


def test_each_row_keeps_its_own_sampling_in_a_mixed_batch(tiny_loaded):
    """Greedy, seeded-sampled, penalised and logprob rows share decode steps; each gives what it
    gives alone."""
    loaded = tiny_loaded("llama")
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS[:4]]
    bias = no_eos(loaded)
    params = [
        greedy(max_tokens=12, logit_bias=bias),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, logit_bias=bias),
        greedy(max_tokens=12, logit_bias=bias, frequency_penalty=2.0),
        SamplingParams(temperature=1.2, min_p=0.05, seed=9, max_tokens=12, logit_bias=bias,
                       logprobs=True, top_logprobs=2),
    ]
    with Engine(loaded, EngineConfig(parallel=4)) as engine:
        handles = [engine.submit(GenerationRequest(p, s)) for p, s in zip(prompts, params)]
        together = [h.collect(TIMEOUT) for h in handles]
        alone = [engine.generate(GenerationRequest(p, s), TIMEOUT) for p, s in zip(prompts, params)]
    for t, a in zip(together, alone):
        assert t.tokens == a.tokens
    assert together[3].logprobs == pytest.approx(alone[3].logprobs, abs=1e-4)


@pytest.mark.parametrize("pipelined", [False, True], ids=["stepwise", "pipelined-decode"])
def test_a_failing_forward_pass_ends_every_request_of_the_engine_and_restart_serves_again(
        tiny_loaded, tmp_path, monkeypatch, pipelined):
    """A forward pass that raises (REWIND_TEST_FORWARD_FAULT, rewind.engine.faults) ends the
    rows that were in it, the row waiting for a slot and nothing else: each gets an "error"
    FinishEvent at once; the engine then takes nothing until restart(), which serves the same
    answer as before on a new runner. Pipelined decode (the GPUs' default) queues a step before
    reading the last one: the same holds there."""
    loaded = tiny_loaded("llama")
    trigger = tmp_path / "fault"
    monkeypatch.setenv("REWIND_TEST_FORWARD_FAULT", str(trigger))
    prompt = loaded.tokenizer.encode("hello world")
    endless = greedy(max_tokens=2000, logit_bias=no_eos(loaded))
    config = EngineConfig(parallel=2, max_queue=8, pipeline_decode=pipelined)
    with Engine(loaded, config) as engine:
        expected = engine.generate(GenerationRequest(prompt, greedy(max_tokens=6)), TIMEOUT)
        handles = [engine.submit(GenerationRequest(prompt, endless)) for _ in range(3)]
        assert isinstance(next(handles[0].events(TIMEOUT)), TokenEvent)  # decoding now
        trigger.write_text("")  # empty: any model's next forward pass
        finishes = [handle.collect(TIMEOUT).finish for handle in handles]
        assert [f.reason for f in finishes] == ["error"] * 3
        assert all("engine failure: InjectedFault" in f.error for f in finishes)
        assert not trigger.exists()  # it fired once
        assert engine.failure is not None and "InjectedFault" in engine.failure
        engine._thread.join(TIMEOUT)
        assert not engine.alive
        with pytest.raises(EngineStoppedError, match="restarted"):
            engine.submit(GenerationRequest(prompt, greedy()))
        engine.restart()
        assert engine.alive and engine.failure is None and engine.restarts == 1
        again = engine.generate(GenerationRequest(prompt, greedy(max_tokens=6)), TIMEOUT)
        assert again.tokens == expected.tokens
        assert engine.stats()["finish_reasons"] == {"length": 2, "error": 3}
        if pipelined:
            assert engine.stats()["pipelined_steps"] > 0


def test_an_engine_thread_that_dies_leaves_no_request_waiting(tiny_loaded):
    """Whatever ends the engine thread (here an exception Engine._loop does not catch), every
    request in the engine gets its FinishEvent and later submits raise: no caller waits for
    ever."""
    loaded = tiny_loaded("llama")
    prompt = loaded.tokenizer.encode("hello world")
    with Engine(loaded, EngineConfig(parallel=1, max_queue=8)) as engine:
        scheduler = engine._scheduler
        schedule = scheduler.schedule

        def dying_schedule():
            if scheduler.decoding:
                raise SystemExit("the engine thread ends")
            return schedule()

        scheduler.schedule = dying_schedule
        handles = [engine.submit(GenerationRequest(prompt, greedy(max_tokens=50)))
                   for _ in range(2)]
        finishes = [handle.collect(TIMEOUT).finish for handle in handles]
        assert [f.reason for f in finishes] == ["error", "error"]
        assert "SystemExit: the engine thread ends" in finishes[1].error
        engine._thread.join(TIMEOUT)
        assert not engine.alive and "SystemExit" in engine.failure
        with pytest.raises(EngineStoppedError):
            engine.submit(GenerationRequest(prompt, greedy()))
