"""A background thread that runs a handler over a bounded queue of jobs.

The engine thread hands records to the disk tier through this: submit() returns at once unless
the queue is full (then the producer waits, which bounds the RAM held by records in flight).
The handler must not raise; if it does anyway the error is counted and the thread goes on, since
a dead writer would silently stop the disk tier. `on_idle` runs on the same thread after every
`idle_seconds` without a job (a persistent store writes its index then).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Generic, TypeVar

Job = TypeVar("Job")
log = logging.getLogger(__name__)

_STOP = object()  # the sentinel that ends the thread
_POLL_SECONDS = 0.1  # how often a blocked submit() rechecks whether the writer was closed


class Writer(Generic[Job]):
    """One daemon thread calling `handle(job)` for each submitted job, in order."""

    def __init__(
        self, handle: Callable[[Job], None], queue_size: int = 64, name: str = "rewind-writer",
        on_idle: Callable[[], None] | None = None, idle_seconds: float | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if on_idle is not None and not (idle_seconds and idle_seconds > 0):
            raise ValueError(f"on_idle needs idle_seconds > 0, got {idle_seconds}")
        self._handle = handle
        self._on_idle = on_idle
        self._idle_seconds = idle_seconds if on_idle is not None else None
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._closed = threading.Event()
        self._dropping = False  # set by close(drain=False): remaining jobs are skipped
        self._running = threading.Event()  # cleared by pause(): the thread waits between jobs
        self._running.set()
        self.submitted = 0
        self.processed = 0
        self.dropped = 0
        self.errors = 0
        self.blocked_submits = 0  # submits that found the queue full and had to wait
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def pending(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> bool:
        """Queue a job; blocks only while the queue is full. False if the writer is closed."""
        if self._closed.is_set():
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.blocked_submits += 1
            while True:
                if self._closed.is_set():
                    return False
                try:
                    self._queue.put(job, timeout=_POLL_SECONDS)
                    break
                except queue.Full:
                    continue
        self.submitted += 1
        return True

    def pause(self) -> None:
        """Hold jobs in the queue after the current one (disk busy elsewhere; tests)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far is handled; False on timeout."""
        if timeout is None:
            self._queue.join()
            return True
        # Queue.join has no timeout: wait on its condition ourselves.
        done = threading.Event()

        def wait_join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait_join, daemon=True).start()
        return done.wait(timeout)

    def close(self, drain: bool = False, timeout: float = 30.0) -> None:
        """Stop the thread; jobs still queued are handled if `drain`, else dropped."""
        if self._closed.is_set():
            return
        self._dropping = not drain
        self._closed.set()
        self._running.set()
        while True:  # the stop sentinel must get in even if the queue is full
            try:
                self._queue.put(_STOP, timeout=_POLL_SECONDS)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        return {
            "queued": self._queue.qsize(),
            "submitted": self.submitted,
            "processed": self.processed,
            "dropped": self.dropped,
            "errors": self.errors,
            "blocked_submits": self.blocked_submits,
        }

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self._idle_seconds)
            except queue.Empty:  # only with on_idle: nothing came for idle_seconds
                self._idle()
                continue
            self._running.wait()
            try:
                if job is _STOP:
                    self._discard_rest()
                    return
                if self._dropping:
                    self.dropped += 1
                    continue
                try:
                    self._handle(job)  # type: ignore[arg-type]
                    self.processed += 1
                except Exception:  # noqa: BLE001 - the writer must outlive any one bad job
                    self.errors += 1
                    log.exception("writer job failed")
            finally:
                self._queue.task_done()

    def _idle(self) -> None:
        try:
            self._on_idle()  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - as for a job: the writer must go on
            self.errors += 1
            log.exception("writer idle task failed")

    def _discard_rest(self) -> None:
        # A submit that raced close() may have queued behind the sentinel: settle it so that
        # flush() cannot wait forever.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self.dropped += 1
            self._queue.task_done()
