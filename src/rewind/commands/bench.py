"""`rewind bench WORKLOAD ...`: each workload is a module in rewind.bench with
`register(parser)` (adds its own options) and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib

WORKLOADS = {
    "speed": "rewind.bench.speed",
    "kv-append": "rewind.bench.kv_append",
    "model-forms": "rewind.bench.model_forms",
    "prompt-cache": "rewind.bench.prompt_cache_bench",
    "agentic": "rewind.bench.agentic",
    "multi-round-qa": "rewind.bench.multi_round_qa",
    "parallel-chat": "rewind.bench.parallel_chat",
    "long-prompts-memory": "rewind.bench.long_prompts_memory",
    "repeated-image": "rewind.bench.repeated_image",
    "disk-tier": "rewind.bench.disk_tier",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark; results go to benchmarks/results/")
    workloads = parser.add_subparsers(dest="workload", metavar="WORKLOAD")
    for name, module_name in WORKLOADS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # a workload not built yet
        sub = workloads.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.register(sub)
        sub.set_defaults(func=module.run)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
