"""The Engine: one thread that owns the model, fed by submit() from any thread, streaming events
back through per-request handles (blocking iteration or `async for`)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from rewind.cache.checkpoints import block_tokens_of
from rewind.config import EngineConfig
from rewind.memory import release_free_heap
from rewind.engine.faults import forward_fault
from rewind.engine.grammar import GrammarBackend
from rewind.engine.memory_budget import KvAccount, NeverFits, Ticket
from rewind.engine.model_thread import ModelThread
from rewind.engine.outbox import Outbox
from rewind.engine.request import (
    EngineStoppedError,
    Event,
    FinishEvent,
    GenerationRequest,
    InvalidRequestError,
    TokenEvent,
    Usage,
)
from rewind.engine.sampler import SequenceSampler
from rewind.engine.runner import ModelRunner
from rewind.engine.scheduler import Counters, SampleListener, Scheduler
from rewind.engine.sequence import Sequence
from rewind.engine.step_plan import StepPlan
from rewind.engine.vocab import vocab_size
from rewind.engine.stops import TextStream

log = logging.getLogger(__name__)

SAMPLE_HISTORY = 1024  # recent TTFT / ITL samples kept for stats()


@dataclass
class Completion:
    """A whole request's output, for callers that do not stream."""

    tokens: list[int]
    text: str
    finish: FinishEvent
    logprobs: list[float | None]


class RequestHandle:
    """The caller's end of one request: iterate the events, or cancel.

    Events arrive from the engine thread. Blocking iteration reads a thread-safe queue; the first
    `async for` (or `stream()`) moves delivery onto the running event loop, into an
    asyncio.Queue the engine fills once per step (rewind.engine.outbox), so an async server
    never blocks a worker thread per stream.
    """

    def __init__(self, request_id: str, cancelled: threading.Event, wake_engine: Any,
                 outbox: Outbox | None = None) -> None:
        self.request_id = request_id
        self._cancelled = cancelled
        self._wake_engine = wake_engine
        self._outbox = outbox or Outbox()
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event | None]] | None = None
        self.finished = False
        # Set when the request holds a slot with its cached prefix restored; from then on
        # `usage.cached_tokens` (the engine's live Usage of this request) is final.
        self.admitted = threading.Event()
        self.usage: Usage | None = None

    def _deliver(self, event: Event) -> None:
        """Engine thread: hand one event to the caller."""
        with self._lock:
            if isinstance(event, FinishEvent):
                self.finished = True
            if self._async is None:
                self._events.put(event)
                return
            loop, async_queue = self._async
        self._outbox.post(loop, (async_queue, event, self._cancelled))

    def cancel(self) -> None:
        """Stop generating; the slot and its cache are freed at the engine's next step."""
        if not self.finished:
            self._cancelled.set()
            self._wake_engine()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Blocking iteration; `timeout` bounds the wait for each event (TimeoutError)."""
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from the engine for {timeout}s") from None
            yield event
            if isinstance(event, FinishEvent):
                return

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._only_events()

    async def _only_events(self) -> AsyncIterator[Event]:
        async for event in self.stream():
            if event is not None:
                yield event

    async def stream(self, idle_seconds: float | None = None) -> AsyncIterator[Event | None]:
        """The events on the running loop, to the FinishEvent; with `idle_seconds`, also None
        after each such stretch without one (a server's keep-alive). One reader per handle.

        The keep-alive is one timer per idle stretch, not one per event: a stream of thousands
        of tokens a second pays a clock read per event."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._async is None:
                fresh: asyncio.Queue[Event | None] = asyncio.Queue()
                while not self._events.empty():  # what arrived before the first `async for`
                    fresh.put_nowait(self._events.get_nowait())
                self._async = (loop, fresh)
            async_queue = self._async[1]
        last_event = loop.time()
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal timer, last_event
            assert idle_seconds is not None
            now = loop.time()
            if now - last_event >= idle_seconds:
                async_queue.put_nowait(None)
                last_event = now
            timer = loop.call_at(last_event + idle_seconds, tick)

        if idle_seconds is not None:
            timer = loop.call_at(last_event + idle_seconds, tick)
        try:
            while True:
                event = await async_queue.get()
                if event is not None:
                    last_event = loop.time()
                yield event
                if isinstance(event, FinishEvent):
                    return
        finally:
            if timer is not None:
                timer.cancel()

    def collect(self, timeout: float | None = None) -> Completion:
        """Wait for the whole output."""
        tokens: list[int] = []
        texts: list[str] = []
        logprobs: list[float | None] = []
        for event in self.events(timeout):
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
                texts.append(event.text)
                logprobs.append(event.logprob)
            else:
                return Completion(tokens, "".join(texts), event, logprobs)
        raise RuntimeError("event stream ended without a FinishEvent")  # unreachable


@dataclass(frozen=True)
class StepTiming:
    """perf_counter stamps of one step: schedule() began, runner.run began, postprocess began,
    postprocess ended."""

    started: float
    planned: float
    ran: float
    ended: float

    @property
    def schedule_ms(self) -> float:
        return (self.planned - self.started) * 1e3

    @property
    def run_ms(self) -> float:
        return (self.ran - self.planned) * 1e3

    @property
    def postprocess_ms(self) -> float:
        return (self.ended - self.ran) * 1e3

    @property
    def total_ms(self) -> float:
        return (self.ended - self.started) * 1e3


StepListener = Callable[[StepPlan, StepTiming], None]


def _eos_token_ids(tokenizer: Any, config: dict) -> set[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


def _check_token_ids(tokens: list[int], vocab_size: int, what: str) -> None:
    try:
        low, high = min(tokens), max(tokens)
        out_of_range = low < 0 or high >= vocab_size
    except TypeError as exc:
        raise InvalidRequestError(f"{what} token ids must be integers") from exc
    if out_of_range:
        bad = low if low < 0 else high
        raise InvalidRequestError(f"{what} token id {bad} is outside this model's vocabulary "
                                  f"(ids 0 to {vocab_size - 1})")


class Engine:
    """Continuous batching over one model. `submit` from any thread; events via the handle."""

    def __init__(self, loaded: Any, config: EngineConfig | None = None,
                 prompt_cache: Any = None, memory: KvAccount | None = None,
                 draft: Any = None, thread: ModelThread | None = None) -> None:
        self.loaded = loaded
        # The model's own thread (rewind.engine.model_thread), where its engines run one after
        # another and share what MLX keeps per thread (a warm-up's compiled steps and cuDNN
        # graphs); None: a thread of this engine's own.
        self.model_thread = thread
        self.config = config or EngineConfig()
        if self.config.parallel < 1:
            raise ValueError("parallel must be >= 1")
        if self.config.kv_bits is not None:
            log.warning("kv_bits=%s ignored: mlx-lm's batch caches do not quantize",
                        self.config.kv_bits)
        if self.config.max_kv_size is not None:
            log.warning("max_kv_size=%s: mlx-lm's batch caches drop the rotating cache's 'keep' "
                        "tokens, so past that size batched output can differ from batch-1",
                        self.config.max_kv_size)
        self.prompt_cache = prompt_cache
        # Where the memory budget is kept, this engine's account in it: the scheduler admits a
        # sequence with room for its prompt's cache and grows it before each token
        # (rewind.engine.memory_budget). None: no budget.
        self.memory = memory
        # A loaded draft model (rewind.engine.draft_model): it drafts where rows verify drafts.
        self.draft_model = None
        if draft is not None:
            from rewind.engine.draft_model import DraftModel, check_compatible

            check_compatible(loaded, draft)
            self.draft_model = DraftModel(draft)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = _eos_token_ids(loaded.tokenizer, loaded.config)
        self.vocab_size = vocab_size(loaded.tokenizer, loaded.config)
        self._grammar = GrammarBackend(loaded.tokenizer, self.vocab_size, self.eos_token_ids)
        self._listeners: list[SampleListener] = [self._record_sample]
        self._step_listeners: list[StepListener] = []
        self._samples: dict[str, deque[float]] = {}
        self._build()
        self._wakeup = threading.Event()
        self._outbox = Outbox()  # the async readers' events, sent once per step
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_done: Future[None] | None = None  # the loop's run on the model thread
        self._started_at = 0.0
        # Why the engine stopped itself (see _fail); None while it serves. restart() clears it.
        self.failure: str | None = None
        self.restarts = 0

    def _build(self, counters: Counters | None = None) -> None:
        """The runner and the scheduler: everything a step touches besides the model."""
        self.runner = ModelRunner(
            self.loaded.model, max_kv_size=self.config.max_kv_size,
            chunk_tokens=self.config.chunk_tokens, block_tokens=block_tokens_of(self.prompt_cache),
            fault=forward_fault(str(getattr(self.loaded, "name", ""))), thread=self.model_thread)
        self._scheduler = Scheduler(self.runner, self.config, self.prompt_cache,
                                    self.eos_token_ids, self._listeners, counters, self.memory,
                                    draft_model=self.draft_model)

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is not None or self._loop_done is not None:
            return self
        self._stopping.clear()
        self._started_at = time.time()
        if self.model_thread is not None:
            self._loop_done = self.model_thread.submit(self._run_on_model_thread)
        else:
            self._thread = threading.Thread(target=self._run, name="rewind-engine", daemon=True)
            self._thread.start()
        # A process that exits without shutdown() must still stop the thread cleanly (above).
        atexit.register(self.shutdown)
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight end with reason "cancelled"."""
        thread, loop_done = self._thread, self._loop_done
        if thread is None and loop_done is None:
            return
        self._stopping.set()
        self._wakeup.set()
        inside = (loop_done is not None and self.model_thread is not None
                  and self.model_thread.on_thread())  # a listener: the loop ends after this step
        if thread is not None:
            thread.join(timeout)
        elif loop_done is not None and not inside and wait([loop_done], timeout).not_done:
            log.warning("the engine loop did not stop within %.0f s; a later engine on this "
                        "model's thread runs once it does", timeout)
        self._thread = self._loop_done = None
        atexit.unregister(self.shutdown)
        self._scheduler.abort_all("cancelled", "the engine shut down")

    def restart(self) -> Engine:
        """Serve again after a failure (`failure` set): a new runner and scheduler over the same
        model and prompt cache, on a new thread; the counters carry on. The model pool restarts
        engines it owns with their model loaded again; this is for an engine the caller owns."""
        self.shutdown()
        self._build(self._scheduler.counters)
        self.failure = None
        self.restarts += 1
        return self.start()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        if self._loop_done is not None:
            return not self._loop_done.done()
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, memory_ticket: Ticket | None = None
               ) -> RequestHandle:
        """Queue a request; raises QueueFullError past max_queue, InvalidRequestError on bad
        input (a prompt whose cache could never fit the memory budget too), EngineStoppedError
        when the engine is not running. `memory_ticket`: room for its prompt's cache already
        taken in the memory budget (the server waits for it at its door); the engine grows it
        and gives it back. Without one, an engine with a budget takes it at admission."""
        if self.failure is not None:
            raise EngineStoppedError(f"the engine stopped after a failure ({self.failure}); "
                                     "retry: it is being restarted")
        if not self.alive or self._stopping.is_set():
            raise EngineStoppedError("the engine is not running")
        if not request.prompt_tokens:
            raise InvalidRequestError("the prompt is empty")
        # Ids reach the embedding lookup and native kernels unchecked: one out of range there is
        # a crash of the whole process, not an error of this request.
        _check_token_ids(request.prompt_tokens, self.vocab_size, "prompt")
        if request.model_tokens is not None:
            _check_token_ids(request.model_tokens, self.vocab_size, "model_tokens")
        if (request.model_tokens is not None
                and len(request.model_tokens) != len(request.prompt_tokens)):
            raise InvalidRequestError(f"model_tokens has {len(request.model_tokens)} ids for "
                                      f"{len(request.prompt_tokens)} prompt tokens")
        request.params.validate()
        if memory_ticket is None and self.memory is not None:
            try:
                self.memory.check(len(request.prompt_tokens) + 1)
            except NeverFits as exc:
                raise InvalidRequestError(str(exc)) from exc
        cancelled = threading.Event()
        handle = RequestHandle(request.request_id, cancelled, self._wakeup.set, self._outbox)
        sequence = Sequence(
            request=request,
            emit=handle._deliver,
            sampler=SequenceSampler(request.params, request.prompt_tokens, self.vocab_size,
                                    self._grammar.constraint(request.grammar)
                                    if request.grammar else None),
            text=TextStream(self.tokenizer, request.params.stop),
            submitted_at=time.perf_counter(),
            usage=Usage(prompt_tokens=len(request.prompt_tokens)),
            cancelled=cancelled,
            admitted=handle.admitted,
            ticket=memory_ticket,
        )
        handle.usage = sequence.usage
        self._enqueue(sequence)
        self._wakeup.set()
        return handle

    def _enqueue(self, sequence: Sequence) -> None:
        """Hand a submitted sequence to the scheduler (rewind.parallel.replay's leader holds it
        for the next step's broadcast instead)."""
        self._scheduler.enqueue(sequence)

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> Completion:
        """submit + collect: the whole output of one request."""
        return self.submit(request).collect(timeout)

    # ---- observation ------------------------------------------------------------------------

    def add_sample_listener(self, listener: SampleListener) -> None:
        """`listener(name, seconds)` on the engine thread for each sample of: ttft_seconds,
        itl_seconds, queue_seconds, restore_seconds (for metrics histograms). Keep it cheap."""
        self._listeners.append(listener)

    def _record_sample(self, name: str, value: float) -> None:
        self._samples.setdefault(name, deque(maxlen=SAMPLE_HISTORY)).append(value)

    def recent_samples(self, name: str) -> list[float]:
        return list(self._samples.get(name, ()))

    def stats(self) -> dict[str, Any]:
        sched = self._scheduler
        counters = sched.counters
        return {
            "running": sched.running,
            "queued": sched.queued,
            "decoding": len(sched.decoding),
            "prefilling": len(sched.prefilling),
            "parallel": self.config.parallel,
            "max_queue": self.config.max_queue,
            "requests_finished": counters.requests_finished,
            "steps": counters.steps,
            "pipelined_steps": counters.pipelined_steps,
            # decode steps through the compiled call (rewind.engine.compiled_decode)
            "compiled_decode_steps": (0 if self.runner.compiled_decode is None
                                      else self.runner.compiled_decode.steps),
            "compiled_decode_traces": self._compiled_traces(),
            "finish_reasons": dict(counters.finish_reasons),
            "prompt_tokens": counters.prompt_tokens,
            "prefilled_tokens": counters.prefilled_tokens,
            "prefill_token_layers": counters.prefill_token_layers,
            "partial_chunk_calls": counters.partial_chunk_calls,
            "extra_prefill_passes": counters.extra_prefill_passes,
            "layers_per_chunk": sched.layer_count or 1,
            "generated_tokens": counters.generated_tokens,
            "cached_tokens": counters.cached_tokens,
            "cached_ram_tokens": counters.cached_ram_tokens,
            "cached_disk_tokens": counters.cached_disk_tokens,
            **self._speculation_stats(),
            "uptime_seconds": time.time() - self._started_at if self._started_at else 0.0,
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
        }

    def _compiled_traces(self) -> int:
        compiled = self.runner.compiled_decode
        return 0 if compiled is None else compiled.traces

    def _speculation_stats(self) -> dict[str, Any]:
        speculator = self._scheduler.speculator
        if speculator is None:
            return {"speculative": "off"}
        counters = speculator.counters
        return {"speculative": speculator.mode,
                "speculative_steps": counters.steps,
                "drafted_tokens": counters.drafted_tokens,
                "accepted_tokens": counters.accepted_tokens}

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._run_on_model_thread()
        finally:
            # MLX keeps per-thread streams and compile caches; a thread that ends without
            # clearing them makes the process abort at exit ("terminate called ...").
            mx.clear_streams()

    def _run_on_model_thread(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the loop, no request waits
            self._fail(exc)

    def step(self) -> bool:
        """One engine step, engine thread only: the scheduler plans a forward pass, the runner
        runs it, the scheduler reads its output (rewind.engine.step_plan). False when there was
        nothing to run."""
        scheduler = self._scheduler
        started = time.perf_counter()
        plan = scheduler.schedule()
        if plan is None:
            return False
        planned = time.perf_counter()
        traces = self._compiled_traces()
        out = self.runner.run(plan)
        ran = time.perf_counter()
        scheduler.postprocess(plan, out)
        if self._step_listeners or log.isEnabledFor(logging.DEBUG):
            timing = StepTiming(started, planned, ran, time.perf_counter())
            if log.isEnabledFor(logging.DEBUG):
                # Where a stream's time between tokens goes (`rewind serve --log-level debug`).
                layers = self.runner.layer_count or 1
                work = ", ".join(f"{c.end - c.start}x{(c.stop or layers) - c.first}"
                                 for c in plan.prefill)
                log.debug("step %d%s: %d decoding (%d drafting), prefill [%s] (tokens x "
                          "layers), %.1f ms (schedule %.1f, run %.1f, postprocess %.1f)%s",
                          scheduler.counters.steps, " (further pass)" if plan.continuation
                          else "", plan.decode_rows, len(plan.drafts), work,
                          timing.total_ms, timing.schedule_ms, timing.run_ms,
                          timing.postprocess_ms,
                          ", traced a new compiled decode shape"
                          if self._compiled_traces() != traces else "")
            for listener in self._step_listeners:
                try:
                    listener(plan, timing)
                except Exception:  # a bench's hook must not break generation
                    log.exception("step listener failed")
        return True

    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener(plan, timing)` after every step, on the engine thread (benches time
        the three calls with it)."""
        self._step_listeners = [*self._step_listeners, listener]

    def remove_step_listener(self, listener: StepListener) -> None:
        self._step_listeners = [f for f in self._step_listeners if f != listener]

    def _loop(self) -> None:
        busy = False
        while not self._stopping.is_set():
            self._wakeup.clear()  # before the step: a submit during it keeps the flag set
            try:
                with self._outbox.batch():  # the step's events reach their loops at its end
                    did_work = self.step()
                if busy and not did_work:
                    # Idle again: the requests' temporaries are freed (by reference counting; a
                    # full garbage collection would hold the next request ~45 ms): hand them
                    # back.
                    mx.clear_cache()
                    release_free_heap(collect=False)
            except Exception as exc:  # a failure outside any one request: see _fail
                self._fail(exc)
                return
            busy = did_work
            if not did_work:
                self._wakeup.wait(0.5)  # until submit / cancel / shutdown sets it

    def _fail(self, exc: BaseException) -> None:
        """Stop after a failure no single request can be blamed for (a forward pass that
        raised: which row caused it is unknown, and the caches and the runner's state may be
        half advanced): every request in the engine ends at once with reason "error", later
        submits raise EngineStoppedError, and the thread ends. Its owner restarts it (the model
        pool: with its model loaded again; see restart())."""
        self.failure = f"{type(exc).__name__}: {exc}"
        log.error("the engine of %s failed (%s): its requests end with an error and it stops "
                  "until restarted", getattr(self.loaded, "name", "?"), self.failure,
                  exc_info=exc)
        try:
            self._scheduler.close("error", f"engine failure: {self.failure}")
        except Exception:  # noqa: BLE001 - logged; the thread ends either way
            log.exception("ending the requests of the failed engine failed")
