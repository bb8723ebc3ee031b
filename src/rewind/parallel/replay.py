"""Rank 0's engine and the other ranks' engines: the same Engine and Scheduler everywhere, with
rank 0 deciding what each step starts from.

Rank 0 (`LeaderEngine`) takes requests from HTTP like any Engine, but they reach its scheduler
only at a step boundary: before each step it sends the other ranks a StepInputs (requests
submitted and cancelled since the last step), applies the same plan itself, then steps. The other
ranks (`FollowerEngine`) receive each plan, apply it to their own scheduler and step. Admission,
chunking, batching, checkpoints and sampling are deterministic given the plan and the logits
(identical on every rank: the last projection's sum over the ranks is one ring all-reduce), so
every rank issues the same forward calls, whose collectives pair up.

What would break that determinism is settled on rank 0 before the plan is sent: a request
without a seed gets one (the sampler would otherwise draw its own per rank), and a cancellation
counts from the step whose plan carries it (a client may hang up at any moment on rank 0 only).
The prompt cache agrees on restore points separately (agreed_cache). Only step boundaries and
these inputs cross the network, so the Scheduler itself is unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from typing import Any

import mlx.core as mx

from rewind.engine import Engine
from rewind.engine.request import FinishEvent, GenerationRequest, QueueFullError
from rewind.engine.sequence import Sequence
from rewind.parallel.group import broadcast_bytes
from rewind.parallel.plans import StepInputs, check_replayable

log = logging.getLogger(__name__)


class LeaderEngine(Engine):
    """Rank 0: an Engine whose every step is announced to the other ranks first."""

    def __init__(self, loaded: Any, config: Any, prompt_cache: Any,
                 group: mx.distributed.Group) -> None:
        super().__init__(loaded, config, prompt_cache)
        self.group = group
        self._plan_lock = threading.Lock()
        self._pending: list[Sequence] = []  # submitted, not yet in a plan
        # request id -> (its sequence, the handle's cancel flag); the sequence's own flag is
        # set only when a plan carries the cancellation.
        self._live: dict[str, tuple[Sequence, threading.Event]] = {}

    def submit(self, request: GenerationRequest, memory_ticket: Any = None) -> Any:
        """`memory_ticket` stays with the server's request (it gives it back at the request's
        end) and is not grown here: a row cut by the budget on rank 0 alone would leave the
        other ranks stepping a batch rank 0 no longer has."""
        check_replayable(request)
        if request.params.seed is None:  # the same draws on every rank
            request = dataclasses.replace(
                request, params=dataclasses.replace(request.params, seed=secrets.randbits(63)))
        return super().submit(request)

    def _enqueue(self, seq: Sequence) -> None:
        """Engine.submit's sequence waits for the next step's inputs instead of the queue."""
        scheduler = self._scheduler
        with self._plan_lock:
            queued = scheduler.queued + len(self._pending)
            if queued >= self.config.max_queue:
                raise QueueFullError(queued, self.config.max_queue,
                                     scheduler.retry_after(queued))
            handle_flag = seq.cancelled
            seq.cancelled = threading.Event()
            self._pending.append(seq)
            self._live[seq.request.request_id] = (seq, handle_flag)

    def _next_plan(self) -> tuple[StepInputs, list[Sequence]]:
        with self._plan_lock:
            new, self._pending = self._pending, []
            cancelled = [rid for rid, (seq, flag) in self._live.items()
                         if flag.is_set() and not seq.cancelled.is_set()]
        return StepInputs([s.request for s in new], cancelled), new

    def _apply(self, plan: StepInputs, new: list[Sequence]) -> None:
        for seq in new:
            emit = seq.emit

            def forget(event: Any, emit: Any = emit, rid: str = seq.request.request_id) -> None:
                if isinstance(event, FinishEvent):
                    with self._plan_lock:
                        self._live.pop(rid, None)
                emit(event)

            seq.emit = forget
            self._scheduler.enqueue(seq)
        for rid in plan.cancelled:
            with self._plan_lock:
                entry = self._live.get(rid)
            if entry is not None:
                entry[0].cancelled.set()

    def _loop(self) -> None:
        scheduler = self._scheduler
        busy = False
        try:
            while not self._stopping.is_set():
                self._wakeup.clear()
                plan, new = self._next_plan()
                if not (busy or plan.submitted or plan.cancelled or scheduler.running
                        or scheduler.queued):
                    self._wakeup.wait(0.5)
                    continue
                broadcast_bytes(self.group, plan.encode())
                self._apply(plan, new)
                busy = step_once(self)
        finally:
            broadcast_bytes(self.group, StepInputs(stop=True).encode())


class FollowerEngine(Engine):
    """Ranks 1..n-1: no HTTP; replays rank 0's plans until told to stop. `run()` blocks."""

    def __init__(self, loaded: Any, config: Any, prompt_cache: Any,
                 group: mx.distributed.Group) -> None:
        super().__init__(loaded, config, prompt_cache)
        self.group = group
        self._handles: dict[str, Any] = {}

    def run(self) -> None:
        self.start()  # the engine thread runs _loop; submit needs it alive
        assert self._thread is not None
        self._thread.join()

    def _loop(self) -> None:
        scheduler = self._scheduler
        while True:
            plan = StepInputs.decode(broadcast_bytes(self.group, None))
            if plan.stop:
                scheduler.abort_all("cancelled", "rank 0 stopped")
                return
            for request in plan.submitted:
                # Engine.submit on the engine thread itself: the scheduler's queue gets it now,
                # as rank 0's does when it applies the same plan.
                self._handles[request.request_id] = Engine.submit(self, request)
            for rid in plan.cancelled:
                handle = self._handles.get(rid)
                if handle is not None:
                    handle._cancelled.set()
            step_once(self)
            self._handles = {rid: h for rid, h in self._handles.items() if not h.finished}


def step_once(engine: Engine) -> bool:
    try:
        return engine.step()
    except Exception as exc:  # as Engine._loop: fail the requests in flight, keep serving
        log.exception("engine step failed")
        engine._scheduler.abort_all("error", f"engine failure: {type(exc).__name__}: {exc}")
        return False
