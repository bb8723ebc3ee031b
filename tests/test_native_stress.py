"""A threaded stress of the native kernels' callers: `rewind serve` (a process of its own, so a
native crash shows as its death, not the test's) on two tiny models of native families with one
loaded at a time, while streams run concurrently on both, some are cancelled mid-stream, models
are unloaded by request, the RAM tier is small enough that the disk writer works throughout,
and the memory budget is tight enough to make requests wait or end.

Issue 23's crashes came from the kernels' pool under this kind of traffic. Run as part of the
suite, and by scripts/sanitize.sh under AddressSanitizer + UBSan (the server inherits the
sanitizer's environment: any report ends it, and the script checks the reports)."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from rewind.bench.harness import ServerProcess, free_port
from rewind.kernels import native

pytestmark = pytest.mark.skipif(native.load_kernels() is None,
                                reason="needs the C kernels (x86-64 AVX2 and a C compiler)")

SECONDS = float(os.environ.get("NATIVE_STRESS_SECONDS", "20"))  # 45, then 30, until CI neared 20 min
CLIENTS = 6


def _stream(client: openai.OpenAI, model: str, prompt: list[int], cancel_after: int | None,
            errors: list[str], done: list[int]) -> None:
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True)
        for index, _ in enumerate(stream):
            if cancel_after is not None and index >= cancel_after:
                stream.close()  # the client leaves mid-stream: its sequence is cancelled
                break
        done.append(1)
    except (openai.APIStatusError, openai.APIConnectionError, openai.APITimeoutError) as error:
        status = getattr(error, "status_code", None)
        # 429 / 503: the budget or the queue said wait; a client may see that under pressure.
        if status not in (429, 503):
            errors.append(f"{model}: {type(error).__name__} {status}: {str(error)[:200]}")


def test_streams_cancellations_unloads_and_the_disk_writer_together(tiny_model_path,
                                                                    tmp_path: Path) -> None:
    models = [str(tiny_model_path("llama")), str(tiny_model_path("gemma3"))]
    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", *(f"--model={m}" for m in models),
            "--max-models", "1", "--port", str(port), "--parallel", "4", "--max-queue", "64",
            "--cache-ram", "2MiB", "--cache-disk", "24MiB", "--cache-dir", str(tmp_path / "c"),
            "--log-level", "warning"]
    server = ServerProcess("rewind", argv, port, tmp_path / "server.log",
                           ready_paths=("/health",),
                           env={"REWIND_HOME": str(tmp_path / "home"),
                                "HF_HUB_CACHE": str(tmp_path / "hub")})
    errors: list[str] = []
    done: list[int] = []
    with server.start():
        server.wait_ready(180)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120,
                               max_retries=0)
        deadline = time.monotonic() + SECONDS

        def user(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline and server.process.poll() is None:
                length = rng.choice([40, 300, 700])
                prompt = [rng.randrange(3, 500) for _ in range(length)]
                cancel = rng.choice([None, None, 0, 3])
                _stream(client, rng.choice(models), prompt, cancel, errors, done)

        def unloader() -> None:
            rng = random.Random(99)
            while time.monotonic() < deadline and server.process.poll() is None:
                time.sleep(rng.uniform(0.5, 2.0))
                try:
                    httpx.post(f"{server.base_url}/v1/models/unload",
                               json={"model": rng.choice(models)}, timeout=120)
                except httpx.HTTPError as error:
                    errors.append(f"unload: {error}")

        threads = [threading.Thread(target=user, args=(seed,)) for seed in range(CLIENTS)]
        threads.append(threading.Thread(target=unloader))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=SECONDS + 300)
        code = server.process.poll()
        log = server.log_tail(60)
        if code is None:
            health = httpx.get(f"{server.base_url}/health", timeout=30)
            assert health.status_code == 200, health.text
    assert code is None, (f"the server died ({signal.Signals(-code).name if code < 0 else code})"
                          f":\n{log}")
    assert not errors, (errors[:5], log)
    assert len(done) >= 2 * CLIENTS, (len(done), log)
