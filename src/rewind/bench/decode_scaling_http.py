"""Decode tokens/s of `rewind serve` over HTTP: a server on the random model and N concurrent
streamed /v1/completions through the openai client, timed over the all-decoding window.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from rewind.bench.decode_scaling_window import all_decoding_window, stagger_tokens

def start_server(folder: Path, parallel: int, log_dir: Path) -> Any:
    from rewind.bench.harness import LOOPBACK, ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "rewind", "serve", "--model", str(folder), "--host", LOOPBACK,
            "--port", str(port), "--parallel", str(parallel), "--log-level", "warning"]
    # Requests name the folder as served: `default` (and /v1/models' first entry) is the
    # built-in default model, not this one.
    server = ServerProcess("rewind", argv, port, log_dir / f"rewind-serve-{port}.log",
                           ready_paths=("/health",), model_id=str(folder))
    server.start()
    server.wait_ready(timeout=600)
    return server


def run_http(server: Any, prompts: list[list[int]], decode_tokens: int, chunk_tokens: int,
             eos_bias: dict[int, float]) -> dict[str, Any]:
    """N concurrent streamed /v1/completions (token-id prompts) with the openai client, one
    thread each; a stream's token stamps are its SSE chunks with text (one per token here: the
    random ids decode to text)."""
    from openai import OpenAI

    streams, prompt_tokens = len(prompts), len(prompts[0])
    # Twice the engine's margin: requests reach the server over a few milliseconds, not at once.
    max_tokens = decode_tokens + 2 * stagger_tokens(streams, prompt_tokens, chunk_tokens) + 32
    stamps: list[list[float]] = [[] for _ in prompts]
    completion_tokens: list[int | None] = [None] * streams
    reasons: dict[str, int] = {}
    errors: list[str] = []
    barrier = threading.Barrier(streams)

    def one(index: int) -> None:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="bench", timeout=600,
                        max_retries=0)
        try:
            barrier.wait()
            stream = client.completions.create(
                model=server.model_id or "default", prompt=prompts[index],
                max_tokens=max_tokens, temperature=0.0, stream=True,
                logit_bias={str(t): v for t, v in eos_bias.items()},
                stream_options={"include_usage": True})
            for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].text:
                    stamps[index].append(now)
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
                    reasons[reason] = reasons.get(reason, 0) + 1
                if chunk.usage is not None:
                    completion_tokens[index] = chunk.usage.completion_tokens
        except Exception as exc:  # reported, not raised: the other streams' figures still count
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = time.perf_counter() - started
    if errors or not all(stamps):
        return {"error": errors[0] if errors else "a stream sent no text"}
    window = all_decoding_window(stamps, prompt_tokens)
    if window.tokens == 0:
        return {"error": "no span where every stream decoded (requests arrived too far apart)"}
    return {"tok_s": round(window.tok_s, 1), "window_s": round(window.seconds, 3),
            "window_tokens": window.tokens, "mean_context": round(window.mean_context, 1),
            "max_tokens": max_tokens, "total_s": round(total, 2), "finish_reasons": reasons,
            "chunks": sum(len(s) for s in stamps),
            "completion_tokens": sum(t or 0 for t in completion_tokens)}
