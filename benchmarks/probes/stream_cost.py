"""What a streamed token costs `rewind serve`'s event loop: the server's main thread's CPU time
per SSE chunk while N streams decode at once (a tiny random Llama, so the engine makes tokens
fast; every request bans the EOS ids and asks for far more tokens than the window takes).

At 32 streams on a GPU the engine makes ~8,500 tokens/s, and the event loop's Python per token
shares the GIL with the engine's step (issue 27: HTTP 5,097 tokens/s where the engine alone made
8,563 on an H100). This measures that per-token work on any machine, in alternating server
processes of two source trees (`--src A --src B`: e.g. a `git worktree` of the base commit and
this checkout), from /proc's per-thread CPU times over a window of steady decoding.

    PYTHONPATH=src python benchmarks/probes/stream_cost.py --src /tmp/base/src --src src --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

EOS_BAN = {str(t): -100 for t in (0, 1, 2, 4)}  # the tiny models' special ids


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each of the process's threads, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def request(api: str, model: str, index: int) -> tuple[str, dict]:
    """(path, body) of one endless streamed request of `api`."""
    words = " ".join(f"word{(index * 7 + i) % 50}" for i in range(40))
    if api == "completions":
        return "/v1/completions", {"model": model, "prompt": list(range(10 + index, 74 + index)),
                                   "max_tokens": 1_000_000, "temperature": 0.0, "stream": True,
                                   "logit_bias": EOS_BAN}
    if api == "chat":
        return "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": words}],
            "max_tokens": 1_000_000, "temperature": 0.0, "stream": True, "logit_bias": EOS_BAN}
    return "/v1/messages", {"model": model, "messages": [{"role": "user", "content": words}],
                            "max_tokens": 1_000_000, "temperature": 0.0, "stream": True,
                            "logit_bias": EOS_BAN}


async def measure(base_url: str, model: str, api: str, streams: int, warm_s: float,
                  window_s: float, pid: int) -> tuple[float, float, float]:
    """(chunks a second, the main thread's CPU seconds, every thread's) over the window."""
    counts = [0] * streams

    async def one(client: httpx.AsyncClient, index: int) -> None:
        path, body = request(api, model, index)
        async with client.stream("POST", f"{base_url}{path}", json=body) as answer:
            answer.raise_for_status()
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    counts[index] += 1

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(streams)]
        await asyncio.sleep(warm_s)
        chunks, cpu, started = sum(counts), thread_cpu(pid), time.perf_counter()
        await asyncio.sleep(window_s)
        elapsed = time.perf_counter() - started
        chunks, after = sum(counts) - chunks, thread_cpu(pid)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    main = after.get(pid, 0.0) - cpu.get(pid, 0.0)
    every = sum(after.values()) - sum(cpu.values())
    return chunks / elapsed, main, every


def run_once(src: Path, model: Path, api: str, streams: int, warm_s: float, window_s: float,
             log_dir: Path) -> dict[str, float]:
    from rewind.bench.harness import LOOPBACK, ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", str(model), "--host", LOOPBACK,
            "--port", str(port), "--parallel", str(streams), "--log-level", "warning"]
    # a tree may name more folders after it (`src:/tmp/extra-site`), searched after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(Path(part).resolve()) for part in str(src).split(os.pathsep))}
    server = ServerProcess("rewind", argv, port, log_dir / f"stream-cost-{port}.log",
                           ready_paths=("/health",), model_id=str(model), env=env)
    server.start()
    try:
        server.wait_ready(timeout=300)
        rate, main, every = asyncio.run(measure(server.base_url, str(model), api, streams,
                                                warm_s, window_s, server.pid))
    finally:
        server.stop()
    chunks = rate * window_s
    return {"chunks_per_s": rate, "main_cpu_s": main, "all_cpu_s": every,
            "main_us_per_chunk": main / chunks * 1e6, "all_us_per_chunk": every / chunks * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/stream_cost.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, action="append",
                        help="a source tree to serve from (its src folder, then any more folders "
                             "for the server's path, joined by ':'); repeat to alternate")
    parser.add_argument("--runs", type=int, default=3, help="server processes per tree")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--api", choices=["completions", "chat", "messages"],
                        default="completions",
                        help="/v1/completions (token ids), /v1/chat/completions or /v1/messages "
                             "(Anthropic's): the chat routes run the reasoning / tool-call "
                             "parser on every token")
    parser.add_argument("--warm-s", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    args = parser.parse_args()
    trees = args.src or [Path(__file__).resolve().parents[2] / "src"]
    from rewind.testing.tiny_models import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="rewind-stream-cost-"))
    model = build_tiny_model("llama", work / "tiny-llama")
    print(f"{args.streams} streams of {args.api}, tiny llama, window {args.window_s:.0f} s after "
          f"{args.warm_s:.0f} s; CPU from /proc per thread")
    print("| run | tree | chunks/s | main thread us/chunk | all threads us/chunk |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for run in range(1, args.runs + 1):
        for tree in trees:
            row = run_once(tree, model, args.api, args.streams, args.warm_s, args.window_s,
                           work)
            print(f"| {run} | {tree} | {row['chunks_per_s']:.0f} | "
                  f"{row['main_us_per_chunk']:.1f} | {row['all_us_per_chunk']:.1f} |",
                  flush=True)
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
