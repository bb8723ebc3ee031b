"""`rewind bench soak`: many streaming clients against one live server for a bounded time.

Each client loops until the deadline over a mix of what agents and people send: short chats,
turns of a growing agent conversation with tools, tool-call requests, images (when the model
takes them), and clients that go away mid-stream, by closing the connection or by timing out.
Meanwhile /health is polled every second and the server's RSS sampled.

Targets: no error answer but 429; /health green throughout; RSS at the end within 10% of RSS
after warm-up (the first fifth of the run, which fills the prompt cache's RAM tier); running and
queued sequences back to 0 once the clients stop. Reported: requests by outcome, and p50/p99 of
time to first token and of the gaps between tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SYSTEM = ("You are a coding agent working in a repository. Use the tools to read and change "
          "files, run tests, and report what you did. ") * 20
TOOLS = [{"type": "function", "function": {
    "name": name, "description": description,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
    for name, description in (("read_file", "Read a file"), ("run_tests", "Run the tests"),
                              ("list_dir", "List a folder"))]
SCENARIOS = ("short_chat", "agent_turn", "tool_call", "disconnect", "client_timeout",
             "short_chat", "agent_turn", "image")
RSS_DRIFT_LIMIT = 0.10


@dataclass
class Outcome:
    scenario: str
    status: int | None  # None: no answer (a transport error)
    ok: bool  # what this scenario should get
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    detail: str = ""


@dataclass
class SoakResult:
    seconds: float
    clients: int
    outcomes: list[Outcome]
    health_checks: int
    health_failures: list[str]
    rss_warm: int
    rss_end: int
    idle_after: dict[str, float]
    rss_timeline: list[tuple[float, int]] = field(default_factory=list)  # (seconds, bytes)

    @property
    def errors(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def rss_drift(self) -> float:
        return (self.rss_end - self.rss_warm) / self.rss_warm if self.rss_warm else 0.0

    def percentiles(self, values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50": None, "p99": None}
        ordered = sorted(values)
        return {"p50": statistics.median(ordered),
                "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}

    def summary(self) -> dict[str, Any]:
        by_outcome = Counter(f"{o.scenario}:{o.status}" for o in self.outcomes)
        return {
            "seconds": round(self.seconds, 1), "clients": self.clients,
            "requests": len(self.outcomes), "errors": len(self.errors),
            "rate_limited": sum(1 for o in self.outcomes if o.status == 429),
            "by_outcome": dict(sorted(by_outcome.items())),
            "health_checks": self.health_checks, "health_failures": len(self.health_failures),
            "rss_warm_bytes": self.rss_warm, "rss_end_bytes": self.rss_end,
            "rss_drift": round(self.rss_drift, 4), "idle_after": self.idle_after,
            "rss_timeline_mib": [(t, round(b / 2**20)) for t, b in self.rss_timeline],
            "ttft_seconds": self.percentiles([o.ttft for o in self.outcomes if o.ttft]),
            "inter_token_seconds": self.percentiles([g for o in self.outcomes for g in o.gaps]),
        }

    @property
    def passed(self) -> bool:
        return (not self.errors and not self.health_failures
                and self.rss_drift <= RSS_DRIFT_LIMIT  # less memory at the end is no leak
                and not any(self.idle_after.values()))


def tiny_png() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class Client:
    """One simulated user: its own agent conversation, which grows turn by turn and starts over
    after `turns_per_session` turns (so the prompt cache's working set stays bounded)."""

    def __init__(self, index: int, url: str, model: str, images: bool,
                 turns_per_session: int = 6) -> None:
        self.index = index
        self.url = url
        self.model = model
        self.images = images
        self.turns_per_session = turns_per_session
        self.history: list[dict[str, Any]] = []
        self.step = 0

    def next_scenario(self) -> str:
        scenario = SCENARIOS[(self.index + self.step) % len(SCENARIOS)]
        self.step += 1
        return "short_chat" if scenario == "image" and not self.images else scenario

    def body(self, scenario: str) -> dict[str, Any]:
        base = {"model": self.model, "stream": True, "temperature": 0.7, "seed": self.step,
                "stream_options": {"include_usage": True}}
        if scenario == "agent_turn":
            if len(self.history) >= 2 * self.turns_per_session:
                self.history = []
            self.history.append({"role": "user", "content": f"Step {len(self.history)}: look "
                                 f"at src/module_{self.index}.py and fix the failing test."})
            return {**base, "max_tokens": 32, "tools": TOOLS,
                    "messages": [{"role": "system", "content": SYSTEM}, *self.history]}
        if scenario == "tool_call":
            return {**base, "max_tokens": 24, "tools": TOOLS, "tool_choice": "auto",
                    "messages": [{"role": "user", "content": "List the src folder."}]}
        if scenario == "image":
            return {**base, "max_tokens": 12, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What colour is this?"},
                {"type": "image_url", "image_url": {"url": tiny_png()}}]}]}
        length = 200 if scenario == "client_timeout" else 16
        return {**base, "max_tokens": length, "messages": [
            {"role": "user", "content": f"Say something short about the number {self.step}."}]}

    async def run_one(self, http: httpx.AsyncClient) -> Outcome:
        scenario = self.next_scenario()
        body = self.body(scenario)
        # A client that times out: it stops reading 0.3 s into the stream.
        timeout = httpx.Timeout(600.0, read=0.3) if scenario == "client_timeout" else None
        started = time.perf_counter()
        outcome = Outcome(scenario, None, ok=False)
        last: float | None = None
        try:
            async with http.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                                   timeout=timeout or httpx.USE_CLIENT_DEFAULT) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.ok = response.status_code == 429
                    outcome.detail = (await response.aread()).decode(errors="replace")[:300]
                    return outcome
                chunks = 0
                text_parts: list[str] = []
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome.detail = json.dumps(event)[:300]
                        return outcome
                    now = time.perf_counter()
                    delta = (event.get("choices") or [{}])[0].get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls") \
                            or delta.get("reasoning_content"):
                        if last is None:
                            outcome.ttft = now - started
                        else:
                            outcome.gaps.append(now - last)
                        last = now
                        text_parts.append(delta.get("content") or "")
                    chunks += 1
                    if scenario == "disconnect" and chunks >= 3:
                        outcome.ok = True  # leaving the block closes the connection
                        return outcome
                if scenario == "agent_turn":
                    self.history.append({"role": "assistant", "content": "".join(text_parts)})
                outcome.ok = True  # a client_timeout whose stream never paused finished too
        except httpx.ReadTimeout:
            outcome.ok = scenario == "client_timeout"
            outcome.detail = "read timeout"
        except httpx.HTTPError as error:
            outcome.detail = f"{type(error).__name__}: {error}"
        return outcome


async def _health(url: str, stop: asyncio.Event, failures: list[str]) -> int:
    checks = 0
    async with httpx.AsyncClient(timeout=5.0) as http:
        while not stop.is_set():
            checks += 1
            try:
                answer = await http.get(f"{url}/health")
                if answer.status_code != 200:
                    failures.append(f"{time.time():.0f}: {answer.status_code}")
            except httpx.HTTPError as error:
                failures.append(f"{time.time():.0f}: {type(error).__name__}")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    return checks


def engine_load(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name, key in (("rewind_running_sequences ", "running"),
                          ("rewind_queue_depth ", "queued"),
                          ("rewind_prompt_cache_disk_queued_bytes ", "disk_queued_bytes")):
            if line.startswith(name):
                values[key] = float(line.split()[-1])
    return values


async def quiesce(url: str, model: str, seconds: float = 60.0) -> dict[str, float]:
    """Wait (bounded) until no sequence runs or waits and the disk writer has written what it
    was handed: the state in which two RSS readings can be compared. The engine hands freed
    heap back to the system when it turns idle, which may be before the writer drained: one
    last one-token request makes it turn idle once more after."""
    load: dict[str, float] = {}
    for nudge in (True, False):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            load = await asyncio.to_thread(engine_load, url)
            if not any(load.values()):
                break
            await asyncio.sleep(0.5)
        if nudge:
            async with httpx.AsyncClient(timeout=60.0) as http:
                await http.post(f"{url}/v1/completions",
                                json={"model": model, "prompt": "idle", "max_tokens": 1})
    return load


async def soak(url: str, model: str, seconds: float, clients: int, rss: Any,
               images: bool = False) -> SoakResult:
    """Drive `clients` concurrent clients for `seconds`; `rss()` reads the server's RSS.

    RSS is compared between two idle moments (quiesce()): after a warm-up of a fifth of the run,
    which fills the RAM tier, and after the run. Mid-run readings include records queued for
    the disk writer (bounded, up to 256 MiB), which are no leak; they go in the timeline."""
    stop = asyncio.Event()
    health_failures: list[str] = []
    health = asyncio.create_task(_health(url, stop, health_failures))
    outcomes: list[Outcome] = []
    timeline: list[tuple[float, int]] = []
    simulated = [Client(i, url, model, images) for i in range(clients)]
    started = time.monotonic()

    async def user(client: Client, until: float) -> None:
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:
            while time.monotonic() < until:
                outcome = await client.run_one(http)
                outcomes.append(outcome)
                if outcome.status == 429:
                    await asyncio.sleep(1.0)

    async def sample_rss(until: float) -> None:
        while time.monotonic() < until:
            timeline.append((round(time.monotonic() - started, 1), rss()))
            await asyncio.sleep(min(5.0, max(0.0, until - time.monotonic())))

    async def phase(length: float) -> None:
        until = time.monotonic() + length
        await asyncio.gather(sample_rss(until), *(user(c, until) for c in simulated))

    await phase(seconds / 5)
    await quiesce(url, model)
    rss_warm = rss()
    await phase(seconds - (time.monotonic() - started))
    elapsed = time.monotonic() - started
    idle = await quiesce(url, model)
    rss_end = rss()
    stop.set()
    checks = await health
    return SoakResult(elapsed, clients, outcomes, checks, health_failures, rss_warm, rss_end,
                      idle, timeline)


# ---------------------------------------------------------------- the bench command


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--seconds", type=float, default=1800)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--cache-ram", default="256MiB",
                        help="the server's RAM tier (filled during warm-up)")
    parser.add_argument("--cache-disk", default="2GiB",
                        help="the server's disk tier (its index grows with the records it holds, "
                        "so it too must fill during warm-up for RSS readings to compare)")
    parser.add_argument("--images", action="store_true", help="send images (a vision model)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def run(args: argparse.Namespace) -> int:
    from rewind.bench.harness import ServerProcess, free_port, tree_rss_bytes
    from rewind.bench.machine import command_line
    from rewind.bench.report import Report, Table
    from rewind.bench.servers import openblas_env

    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        argv = [sys.executable, "-m", "rewind", "serve", "--model", args.model, "--port",
                str(port), "--parallel", str(args.parallel), "--cache-ram", args.cache_ram,
                "--cache-disk", args.cache_disk,
                "--cache-dir", scratch, "--log-level", "warning"]
        server = ServerProcess("rewind", argv, port, Path(scratch) / "server.log",
                               env=openblas_env(), ready_paths=("/health",))
        with server.start():
            server.wait_ready()
            print(f"soak: {args.clients} clients for {args.seconds:.0f} s against "
                  f"{server.base_url} ...", flush=True)
            result = asyncio.run(soak(server.base_url, server.model_id or args.model,
                                      args.seconds, args.clients,
                                      lambda: tree_rss_bytes(server.pid), args.images))
            log_tail = server.log_tail(20)
    summary = result.summary()
    ttft, gaps = summary["ttft_seconds"], summary["inter_token_seconds"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    table = Table("Soak", ["what", "outcome"], [
        ["duration, clients", f"{summary['seconds']:.0f} s, {result.clients}"],
        ["requests", str(summary["requests"])],
        ["errors (anything but 200 and 429, or a broken stream)", str(summary["errors"])],
        ["429 answers", str(summary["rate_limited"])],
        ["/health checks failed", f"{summary['health_failures']} of {result.health_checks}"],
        ["RSS after warm-up -> at the end", f"{result.rss_warm / 2**20:.0f} MiB -> "
         f"{result.rss_end / 2**20:.0f} MiB ({result.rss_drift:+.1%})"],
        ["running / queued sequences after", f"{result.idle_after.get('running')} / "
         f"{result.idle_after.get('queued')}"],
        ["time to first token p50 / p99", f"{ms(ttft['p50'])} / {ms(ttft['p99'])}"],
        ["gap between tokens p50 / p99", f"{ms(gaps['p50'])} / {ms(gaps['p99'])}"],
    ])
    report = Report(workload="soak", command=command_line(),
                    params={"model": args.model, "seconds": args.seconds,
                            "clients": args.clients, "parallel": args.parallel,
                            "cache_ram": args.cache_ram, "cache_disk": args.cache_disk,
                            "images": args.images},
                    servers={"rewind": f"rewind serve --model {args.model} --parallel "
                                       f"{args.parallel} --cache-ram {args.cache_ram} "
                                       f"--cache-disk {args.cache_disk}"},
                    fairness=["one server, no baseline: this is an endurance run"],
                    summary=summary,
                    records=[{"errors": [o.__dict__ for o in result.errors[:50]],
                              "health_failures": result.health_failures[:50]}],
                    tables=[table])
    if not result.passed:
        report.notes.append(f"server log tail: {log_tail}")
    for path in report.write(args.out, "soak"):
        print(f"wrote {path}")
    print(table.markdown())
    return 0 if result.passed else 1
