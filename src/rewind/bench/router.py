"""SGLang's router (`sglang-router` on PyPI, the `router` extra) in front of `rewind serve`
replicas: the command line that starts it, and a wait until it has every replica registered.

The router is a Rust binary behind `python -m sglang_router.launch_router`. It registers each
worker by asking it /server_info and /model_info (rewind.server.worker_info answers them), then
routes each request by its policy:

    cache_aware   a prefix tree of the text each worker was sent; a request whose text matches
                  a worker's tree beyond --cache-threshold (0.3) goes there, others to the
                  least-loaded worker; when loads differ by more than the balance thresholds,
                  to the least loaded regardless
    round_robin   in turn, ignoring the prefix
    manual        sticky by the X-SMG-Routing-Key header: a new key goes to a worker chosen by
                  --assignment-mode (min_group: the one holding the fewest keys), then stays
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import httpx

from rewind.bench.harness import LOOPBACK, ServerProcess, ServerStartError, free_port

POLICIES = ("cache_aware", "round_robin", "manual")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def router_argv(worker_urls: list[str], port: int, policy: str, metrics_port: int) -> list[str]:
    """The router as a user would start it for `policy`, on loopback. Its Prometheus port gets a
    free one too: its default (29000) would collide between two routers on one machine."""
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK,
            "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(metrics_port),
            # A failed request is reported, not retried on another replica (which would hide it).
            "--disable-retries", "--log-level", "warn"]
    if policy == "manual":
        argv += ["--assignment-mode", "min_group"]
    return argv


def start_router(worker_urls: list[str], policy: str, log_dir: Path, model_id: str,
                 timeout: float = 60.0) -> ServerProcess:
    """A started router that has registered every worker as healthy. Raises ServerStartError."""
    if not router_installed():
        raise ServerStartError("sglang-router is not installed (pip install 'rewind-engine[router]')")
    port = free_port()
    router = ServerProcess(f"router-{policy}", router_argv(worker_urls, port, policy, free_port()),
                           port, log_dir / f"router-{policy}-{port}.log",
                           ready_paths=("/health",), model_id=model_id).start()
    try:
        router.wait_ready(timeout=timeout)
        wait_for_workers(router, len(worker_urls), timeout)
    except BaseException:
        router.stop()
        raise
    return router


def wait_for_workers(router: ServerProcess, count: int, timeout: float) -> None:
    """Workers are registered by a background job after the router answers /health: wait until
    /readiness counts them all healthy, so the first request can go to any of them."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                ready = client.get(router.base_url + "/readiness").json()
                if int(ready.get("healthy_workers", 0)) >= count:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
    raise ServerStartError(f"the router did not register {count} healthy workers within "
                           f"{timeout:.0f}s\n{router.log_tail()}")
