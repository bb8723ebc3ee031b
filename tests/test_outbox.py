"""Events for async readers: one hand-over per loop per engine step (rewind.engine.outbox), and
a handle's stream with keep-alives from one timer per idle stretch (RequestHandle.stream)."""

from __future__ import annotations

import asyncio
import threading
import time

from rewind.engine import Engine, FinishEvent, GenerationRequest, SamplingParams, TokenEvent, Usage
from rewind.engine.engine import RequestHandle
from rewind.engine.outbox import Outbox

TIMEOUT = 60.0


class LoopThread:
    """A real event loop on a thread of its own, counting the cross-thread calls it gets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.calls = 0
        original = self.loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float = TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)
        self.loop.close()


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_batch_hands_its_events_over_at_its_end_in_order_once_per_loop() -> None:
    loops = LoopThread(), LoopThread()
    try:
        queues = [loops[0].run(_make_queue()), loops[1].run(_make_queue())]
        outbox, cancelled = Outbox(), threading.Event()
        with outbox.batch():
            for i in range(5):
                outbox.post(loops[i % 2].loop, (queues[i % 2], i, cancelled))
            time.sleep(0.05)  # were any sent, the loops would have queued them by now
            assert [loops[k].run(_size(queues[k])) for k in (0, 1)] == [0, 0]
            before = [lt.calls for lt in loops]
        assert [lt.calls - b for lt, b in zip(loops, before)] == [1, 1]
        assert loops[0].run(_drain(queues[0])) == [0, 2, 4]
        assert loops[1].run(_drain(queues[1])) == [1, 3]
    finally:
        for lt in loops:
            lt.close()


def test_another_threads_post_during_a_batch_goes_out_at_once() -> None:
    lt = LoopThread()
    try:
        queue = lt.run(_make_queue())
        outbox, cancelled = Outbox(), threading.Event()
        with outbox.batch():
            other = threading.Thread(target=outbox.post, args=(lt.loop, (queue, "now", cancelled)))
            other.start()
            other.join(TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while lt.run(_size(queue)) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert lt.run(_drain(queue)) == ["now"]
    finally:
        lt.close()


def test_a_closed_loop_cancels_its_readers() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    outbox, cancelled = Outbox(), threading.Event()
    with outbox.batch():
        outbox.post(loop, (asyncio.Queue(), "lost", cancelled))
        assert not cancelled.is_set()
    assert cancelled.is_set()


def test_a_stream_keeps_alive_only_when_idle() -> None:
    """Events 10 ms apart get no keep-alive at 0.5 s; a 1.6 s silence gets some; the stream
    ends with the FinishEvent."""
    handle = RequestHandle("r", threading.Event(), lambda: None)

    def engine_side(started: threading.Event) -> None:
        started.wait(TIMEOUT)
        for i in range(10):
            handle._deliver(TokenEvent(token=i, text=str(i)))
            time.sleep(0.01)
        time.sleep(1.6)
        handle._deliver(FinishEvent(reason="length", usage=Usage()))

    async def read() -> list:
        started = threading.Event()
        producer = threading.Thread(target=engine_side, args=(started,))
        seen = []
        stream = handle.stream(0.5)
        producer.start()
        started.set()
        async for event in stream:
            seen.append(event)
        producer.join(TIMEOUT)
        return seen

    seen = asyncio.run(asyncio.wait_for(read(), TIMEOUT))
    tokens = [e.token for e in seen if isinstance(e, TokenEvent)]
    assert tokens == list(range(10)) and isinstance(seen[-1], FinishEvent)
    first_idle = seen.index(None)
    assert first_idle >= 10  # none while tokens flowed
    assert 1 <= seen.count(None) <= 5


def test_the_engine_hands_a_steps_events_over_together(tiny_loaded) -> None:
    """Two streams read on one loop: the engine's hand-overs to it are about one per step,
    fewer than the events, and each stream gets all of its tokens in order."""
    loaded = tiny_loaded("llama")
    prompts = [loaded.tokenizer.encode(text) for text in ("hello world", "the quick fox")]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    lt = LoopThread()
    try:
        with Engine(loaded) as engine:
            expected = [engine.generate(GenerationRequest(p, params), TIMEOUT).tokens
                        for p in prompts]

            async def both() -> list[list]:
                handles = [engine.submit(GenerationRequest(p, params)) for p in prompts]

                async def read(handle):
                    return [event async for event in handle]

                return await asyncio.gather(*(read(h) for h in handles))

            before = lt.calls
            streams = lt.run(both())
            calls = lt.calls - before
    finally:
        lt.close()
    events = sum(len(s) for s in streams)
    for stream, tokens in zip(streams, expected):
        assert [e.token for e in stream if isinstance(e, TokenEvent)] == tokens
        assert isinstance(stream[-1], FinishEvent)
    assert calls < events, (calls, events)


async def _make_queue() -> asyncio.Queue:
    return asyncio.Queue()


async def _size(queue: asyncio.Queue) -> int:
    return queue.qsize()


async def _drain(queue: asyncio.Queue) -> list:
    return drain(queue)
