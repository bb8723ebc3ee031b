"""`rewind bench WORKLOAD ...`: each workload is a module in rewind.bench with
`register(parser)` (adds its own options) and `run(args) -> int`.

Workload modules import mlx, mlx-lm and HTTP clients; they are imported only when their workload
runs, so `rewind --help` and every other command start without paying for them.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one line for `rewind bench --help`)
WORKLOADS: dict[str, tuple[str, str]] = {
    "speed": ("rewind.bench.speed", "prefill/decode tokens/s: Rewind vs plain mlx-lm"),
    "model-forms": ("rewind.bench.model_forms", "stored forms of the default model: size, perplexity, speed"),
    "perplexity": ("rewind.bench.perplexity", "perplexity of the default GGUF per CPU weight form, vs llama.cpp's llama-perplexity"),
    "decode-scaling": ("rewind.bench.decode_scaling", "decode tok/s at 1/8/32 streams: engine, HTTP, mlx-lm BatchGenerator, HBM bound (random 1B-class models)"),
    "prompt-cache": ("rewind.bench.prompt_cache_bench", "agent session with reasoning dropped: cache vs none"),
    "disk-tier": ("rewind.bench.disk_tier", "scratch-file store write and restore speed"),
    "agentic": ("rewind.bench.agentic", "S agent sessions x T turns, side by side on each server"),
    "edits": ("rewind.bench.edits", "source files asked back with one change (speculative decoding), alone and S sessions, side by side"),
    "replicas": ("rewind.bench.replicas", "agent sessions through SGLang's router over rewind serve replicas, per routing policy"),
    "multi-round-qa": ("rewind.bench.multi_round_qa", "users x rounds with shared system prompt (LMCache style)"),
    "parallel-chat": ("rewind.bench.parallel_chat", "four short chats at once: --parallel 4 vs 1"),
    "long-prompts-memory": ("rewind.bench.long_prompts_memory", "server RSS under four ~4k-token prompts"),
    "repeated-image": ("rewind.bench.repeated_image", "the same image prompt twice: cache vs none"),
    "agent-session": ("rewind.bench.agent_session", "Claude Code's recorded session with and without the billing-header normalization"),
    "restart": ("rewind.bench.restart", "an agent session's next turn after a server restart, with and without --cache-persist"),
    "soak": ("rewind.bench.soak", "many streaming clients for a bounded time: errors, RSS drift, latency"),
    "model-switch": ("rewind.bench.model_switch", "a request naming an unloaded model -> first token; switches; RSS under a budget (vs mlx-lm's server)"),
    "fuzz": ("rewind.bench.fuzz", "schemathesis against every route of a live server (robustness)"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    listing = "\n".join(f"  {name:<20} {summary}" for name, (_, summary) in WORKLOADS.items())
    parser = subparsers.add_parser(
        "bench", help="run a benchmark; results go to benchmarks/results/",
        description=f"workloads:\n{listing}\n\n`rewind bench WORKLOAD --help` shows a workload's options.\n"
                    "Developer probes (kernels, a decode step's profile, KV append, stored forms' speed,\n"
                    "verification cost) are scripts in the repository's benchmarks/probes/, run as\n"
                    "python benchmarks/probes/X.py.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS), metavar="WORKLOAD")
    parser.add_argument("workload_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run_workload)


def run_workload(args: argparse.Namespace) -> int:
    module_name, summary = WORKLOADS[args.workload]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"rewind bench {args.workload}", description=summary)
    module.register(parser)
    workload_args = parser.parse_args(args.workload_args)
    return module.run(workload_args) or 0
