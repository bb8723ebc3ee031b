"""One OS thread for all of a model's engines, so that what a warm-up builds is there for serving.

MLX keeps per thread what a GPU step builds besides its kernels: the compile cache of mx.compile
(rewind.engine.compiled_decode's traces), the command encoders with their cached CUDA graphs,
and on CUDA the cuDNN attention graphs and cuBLAS handles (`thread_local` in mlx/compile.cpp
and mlx/backend/cuda/, 0.32). A warm-up run through an engine on a thread of its own therefore
warmed only what is kept per process (NVRTC's compiled kernels), and the serving engine, on
another thread, built the rest again inside its first requests. Engines given a ModelThread
run their loops on it, one after another, and share what is kept on it (`keep`).
"""

from __future__ import annotations

import atexit
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

import mlx.core as mx

T = TypeVar("T")


class ModelThread:
    """A single daemon worker thread: callables run on it in the order submitted."""

    def __init__(self, name: str = "rewind-model") -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._kept: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        # At exit after the engines' own hooks (registered later, so run first): the thread
        # clears MLX's streams as it ends.
        atexit.register(self.close)

    def _serve(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                future, call = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(exc)
        finally:
            # MLX keeps per-thread streams and compile caches; a thread that ends without
            # clearing them makes the process abort at exit ("terminate called ...").
            mx.clear_streams()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def submit(self, call: Callable[[], T]) -> Future[T]:
        with self._lock:
            if self.closed:
                raise RuntimeError("this model thread was closed")
            future: Future[T] = Future()
            self._queue.put((future, call))
        return future

    def run(self, call: Callable[[], T], timeout: float | None = None) -> T:
        """`call()` on the thread, waited for; raises what it raised."""
        return self.submit(call).result(timeout)

    def keep(self, key: str, make: Callable[[], T]) -> T:
        """The object kept under `key`, made by `make()` the first time (objects whose MLX state
        lives on this thread, like the compiled decode step)."""
        with self._lock:
            if key not in self._kept:
                self._kept[key] = make()
            return self._kept[key]

    def on_thread(self) -> bool:
        """Whether the caller runs on this thread."""
        return threading.get_ident() == self._thread.ident

    def close(self, timeout: float = 30.0) -> None:
        """Finish what was submitted, then end the thread (clearing MLX's streams on it); from
        the thread itself, the thread ends once the running call returns."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._queue.put(None)
        atexit.unregister(self.close)
        if not self.on_thread():
            self._thread.join(timeout)
        self._kept.clear()
