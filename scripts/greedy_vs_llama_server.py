"""Greedy continuations of the same prompts from `rewind serve` (GGUF blocks read in place) and
llama.cpp's `llama-server` on the same GGUF: how many tokens agree before the first difference.

    .venv/bin/python scripts/greedy_vs_llama_server.py [--prompts 20] [--tokens 48]

Writes benchmarks/results/gguf-in-place/greedy-vs-llama-server.{json,md}. Prompts are 200-token
slices of benchmarks/data/fsf-licenses.txt; each server is started by the bench harness on a
free loopback port and stopped after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from rewind.bench.harness import LOOPBACK, ServerProcess, free_port
from rewind.bench.machine import machine_info
from rewind.bench.servers import llama_cpp_binary, llama_cpp_version
from rewind.models.loader import load_model
from rewind.models.registry import default_gguf, resolve_model

OUT = Path("benchmarks/results/gguf-in-place")
TEXT = Path("benchmarks/data/fsf-licenses.txt")


def complete(port: int, path: str, body: dict) -> str:
    reply = httpx.post(f"http://{LOOPBACK}:{port}{path}", json=body, timeout=600).json()
    return reply["content"] if "content" in reply else reply["choices"][0]["text"]


def run_server(name: str, argv: list[str], prompts: list[str], tokens: int) -> list[str]:
    port = free_port()
    argv = [a.replace("PORT", str(port)) for a in argv]
    server = ServerProcess(name, argv, port, Path(f"/tmp/{name}-{port}.log"),
                           ready_paths=("/health",))
    server.start()
    server.wait_ready()
    try:
        if name == "llama.cpp":
            return [complete(port, "/completion", {"prompt": p, "n_predict": tokens,
                                                   "temperature": 0, "cache_prompt": False,
                                                   "top_k": 1}) for p in prompts]
        return [complete(port, "/v1/completions", {"model": "default", "prompt": p,
                                                   "max_tokens": tokens, "temperature": 0})
                for p in prompts]
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    tokenizer = load_model("default", in_place=True).tokenizer
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    step = max(200, (len(ids) - 200) // args.prompts)
    prompts = [tokenizer.decode(ids[i:i + 200]) for i in range(0, step * args.prompts, step)]
    rewind = run_server("rewind", [sys.executable, "-m", "rewind", "serve", "--model",
                                   str(resolve_model("default")), "--host", LOOPBACK, "--port",
                                   "PORT", "--cpu-weights", "gguf"], prompts, args.tokens)
    llama = run_server("llama.cpp", [str(llama_cpp_binary("llama-server")), "-m",
                                     str(default_gguf()), "--host", LOOPBACK, "--port", "PORT",
                                     "-np", "1"], prompts, args.tokens)
    rows = []
    for prompt, a, b in zip(prompts, rewind, llama):
        ta, tb = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        rows.append({"prompt_tail": prompt[-60:], "rewind": a, "llama_cpp": b,
                     "agreeing_tokens": same, "identical": a == b})
    identical = sum(r["identical"] for r in rows)
    mean_agree = sum(r["agreeing_tokens"] for r in rows) / len(rows)
    report = {"command": " ".join(sys.argv), "machine": machine_info(),
              "llama_cpp": llama_cpp_version(), "tokens": args.tokens, "rows": rows,
              "identical": identical, "mean_agreeing_tokens": mean_agree}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "greedy-vs-llama-server.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["## Greedy continuations: rewind serve (GGUF in place) vs llama-server, same GGUF", "",
             f"Command: `{report['command']}`", "", f"Machine: {report['machine']}", "",
             f"llama.cpp: {report['llama_cpp']}", "",
             f"{identical} of {len(rows)} continuations identical over {args.tokens} tokens; "
             f"tokens agreeing before the first difference: mean {mean_agree:.1f}.", "",
             "| prompt ends | agreeing tokens | rewind | llama-server |", "| --- | --- | --- | --- |"]
    for r in rows:
        cell = lambda t: t.replace("\n", "\\n").replace("|", "/")[:80]  # noqa: E731
        lines.append(f"| {cell(r['prompt_tail'][-30:])} | {r['agreeing_tokens']} | "
                     f"{cell(r['rewind'])} | {cell(r['llama_cpp'])} |")
    (OUT / "greedy-vs-llama-server.md").write_text("\n".join(lines) + "\n")
    print(lines[6], lines[8] if len(lines) > 8 else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
