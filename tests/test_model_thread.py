"""rewind.engine.model_thread: a model's engines run one after another on one thread and share
what MLX keeps per thread, so a warm-up's compiled decode steps serve the next engine's
requests."""

from __future__ import annotations

import threading

import pytest

from rewind import env
from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.engine.model_thread import ModelThread
from rewind.models.loader import load_model


def test_calls_run_in_order_on_one_thread_and_raise_to_the_caller() -> None:
    thread = ModelThread("rewind-test")
    try:
        seen: list[tuple[int, int]] = []
        futures = [thread.submit(lambda i=i: seen.append((i, threading.get_ident())))
                   for i in range(5)]
        for future in futures:
            future.result(10)
        assert [i for i, _ in seen] == list(range(5))
        assert {ident for _, ident in seen} == {thread.ident} != {threading.get_ident()}
        with pytest.raises(ZeroDivisionError):
            thread.run(lambda: 1 / 0, timeout=10)
        assert thread.run(lambda: 7, timeout=10) == 7  # a failed call does not end the thread
        assert thread.keep("k", object) is thread.keep("k", object)
    finally:
        thread.close()
    thread.close()  # twice: nothing more
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)


def _decode_twice(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Two rows decoding, then one (the shorter answer ends): two compiled shapes."""
    no_eos = {int(t): -100.0 for t in engine.eos_token_ids}
    handles = [engine.submit(GenerationRequest(prompt, SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logit_bias=no_eos)))
        for prompt, max_tokens in zip(prompts, (12, 4))]
    return [handle.collect(300).tokens for handle in handles]


def test_a_second_engine_on_the_model_thread_reuses_the_first_ones_traces(tiny_model_path,
                                                                         caplog):
    """The first engine (as a server's warm-up) traces its decode shapes; the serving engine
    after it, on the same model thread, runs the same shapes through the same compiled step
    without tracing again (no step of it marked as tracing) and gives the same tokens, on that
    thread. An engine on a thread of its own traces them anew."""
    import logging

    loaded = load_model(str(tiny_model_path("llama")), native_forward="off")
    prompts = [loaded.tokenizer.encode(text) for text in
               ("one two three", "a longer prompt with a few more words in it")]
    config = EngineConfig(parallel=2, pipeline_decode=False, speculative="off")
    thread = ModelThread("rewind-test-model")
    idents: set[int] = set()
    try:
        with env.overridden({env.COMPILED_DECODE: "on"}):
            with Engine(loaded, config, thread=thread) as warm_up:
                first = _decode_twice(warm_up, prompts)
                assert warm_up.stats()["compiled_decode_traces"] == 2
            with Engine(loaded, config, thread=thread) as serving, \
                    caplog.at_level(logging.DEBUG, logger="rewind.engine.engine"):
                assert serving.runner.compiled_decode is warm_up.runner.compiled_decode
                steps_before = serving.stats()["compiled_decode_steps"]
                serving.add_step_listener(lambda plan, timing: idents.add(threading.get_ident()))
                again = _decode_twice(serving, prompts)
                assert serving.alive
                assert serving.stats()["compiled_decode_traces"] == 2  # nothing new
                assert serving.stats()["compiled_decode_steps"] > steps_before
            assert not [r for r in caplog.records
                        if "traced a new compiled decode shape" in r.getMessage()]
            assert not serving.alive
            with Engine(loaded, config) as alone:
                assert _decode_twice(alone, prompts) == first
                assert alone.stats()["compiled_decode_traces"] == 2  # its own, traced again
    finally:
        thread.close()
    assert again == first
    assert idents == {thread.ident}
