"""Time to first token through `rewind serve` for the requests that show a GPU's one-off costs:
the first request after start-up, a second cold prompt of the same length, a cached turn (the
first prompt plus a short new tail), a cached turn of the same shape, and one whose tail length
is new. One server process per run, in order: by default one without the load-time warm-up and
an empty kernel cache (MLX_PTX_CACHE_DIR), one with the warm-up and an empty kernel cache, and
one with the warm-up and the kernel cache the one before left.

    PYTHONPATH=src python benchmarks/probes/turn_latency.py [--shape qwen3.5-0.8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def first_token_s(client: Any, server: Any, prompt: list[int]) -> float:
    started = time.perf_counter()
    answer = client.post("/v1/completions", json={"model": server.model_id, "prompt": prompt,
                                                  "max_tokens": 1, "temperature": 0.0})
    answer.raise_for_status()
    if not answer.json()["choices"]:
        raise RuntimeError("no choice in the answer")
    return time.perf_counter() - started


SERVER_SUMS = {"engine_ttft_s": "rewind_time_to_first_token_seconds_sum",
               "queue_s": "rewind_queue_seconds_sum",
               "restore_s": "rewind_prompt_cache_restore_seconds_sum"}


def server_sums(server: Any) -> dict[str, float]:
    """The server's own histogram sums (every model's): the engine's first-token time from its
    submit, the queue wait, the prompt-cache restore. A request's share is the difference."""
    import httpx

    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    sums = dict.fromkeys(SERVER_SUMS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, metric in SERVER_SUMS.items():
            if name == metric:
                sums[key] += float(line.rsplit(" ", 1)[1])
    return sums


def main() -> int:
    from rewind.bench.harness import LOOPBACK, ServerProcess, free_port
    from rewind.bench.decode_scaling_models import QUICK_SHAPES, SHAPES, build_model, make_prompts

    parser = argparse.ArgumentParser(prog="python benchmarks/probes/turn_latency.py", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3.5-0.8b", help=", ".join({**SHAPES, **QUICK_SHAPES}))
    parser.add_argument("--prefix", type=int, default=3200)
    parser.add_argument("--runs", default="empty/no-warm-up,empty/warm-up,kept/warm-up",
                        help="comma-separated kernel-cache/warm-up pairs, one server each")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    family, overrides = {**SHAPES, **QUICK_SHAPES}[args.shape]
    work = Path(tempfile.gettempdir()) / "rewind-probe-models"  # shared by the probes
    loaded = build_model(args.shape, family, overrides, work)
    vocab = int(loaded.config.get("vocab_size") or overrides["vocab_size"])
    del loaded
    results: list[dict[str, Any]] = []
    kernel_cache = work / "kernels-0"
    for process, run in enumerate(args.runs.split(","), start=1):
        cache_state, warm = run.split("/")
        if cache_state == "empty":
            kernel_cache = work / f"kernels-{process}"
        seed = 1000 * process  # new prompts for each process: its prompt cache starts empty anyway
        first, second = make_prompts(2, args.prefix, vocab, seed)
        tail, other_tail, new_tail = (make_prompts(1, n, vocab, seed + n)[0] for n in (155, 156, 91))
        other_tail = other_tail[:155]
        requests = [
            ("cold, first request after start-up", first),
            ("cold, second prompt of the same length", second),
            ("cached turn: first + 155 new tokens", first + tail),
            ("cached turn of the same shape: second + 155 new", second + other_tail),
            ("cached turn, new tail length: first + 155 + 91 new", first + tail + new_tail),
        ]
        port = free_port()
        argv = [sys.executable, "-m", "rewind", "serve", "--model", str(work / args.shape),
                "--host", LOOPBACK, "--port", str(port), "--parallel", "1",
                "--log-level", "info"] + (["--no-warm-up"] if warm == "no-warm-up" else [])
        server = ServerProcess("rewind", argv, port, work / f"serve-{process}.log",
                               env={"MLX_PTX_CACHE_DIR": str(kernel_cache)},
                               ready_paths=("/health",), model_id=str(work / args.shape))
        started = time.perf_counter()
        server.start()
        server.wait_ready(timeout=900)
        ready_s = time.perf_counter() - started
        label_run = f"run {process} ({run})"
        # Plain HTTP, one client a server: the openai client walks a token-id prompt element by
        # element before sending it (~32 ms for 3,355 ids, measured on the CPU from the client's
        # send to the handler's entry), and building a client costs ~30 ms more. Neither is the
        # server's, and agents send text.
        import httpx

        client = httpx.Client(base_url=server.base_url, timeout=600)
        try:
            for label, prompt in requests:
                before = server_sums(server)
                seconds = first_token_s(client, server, prompt)
                inside = {k: round(v - before[k], 4) for k, v in server_sums(server).items()}
                results.append({"run": run, "process": process, "request": label,
                                "prompt_tokens": len(prompt), "seconds": round(seconds, 4),
                                **inside})
                print(f"{label_run}: {label} ({len(prompt)} tokens): {seconds:.3f} s (engine "
                      f"{inside['engine_ttft_s']:.3f}, queue {inside['queue_s']:.3f}, restore "
                      f"{inside['restore_s']:.3f})", flush=True)
        finally:
            client.close()
            server.stop()
        results.append({"run": run, "process": process, "request": "server start to ready",
                        "seconds": round(ready_s, 2)})
        print(f"{label_run}: start to ready {ready_s:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
