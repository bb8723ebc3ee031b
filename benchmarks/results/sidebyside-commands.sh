#!/usr/bin/env bash
# The commands that produced the side-by-side results in this folder (agentic, multi-round-qa,
# parallel-chat, long-prompts-memory) on the Intel Xeon (Sapphire Rapids, 2 cores) machine, run
# one after another (never two at once), written to /tmp/bench-out and copied here.
#
# Every run measured a frozen worktree, not the tree being edited: the servers the bench starts
# inherit PYTHONPATH, and each result records rewind_source / rewind_commit (machine facts) and
# each Rewind server's "rewind from ..." log line (runs.*.code).
#   git worktree add --detach /work/bench-tree <commit>
# llama.cpp is llama-cpp-python[server] built by scripts/install-llama-cpp.sh into
# .bench-venvs/llama-cpp of the main checkout (LLAMA_CPP_VENV points the worktree at it).
set -euo pipefail
tree="${BENCH_TREE:-/work/bench-tree}"
main="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$tree"
export PYTHONPATH="$tree/src" LLAMA_CPP_VENV="$main/.bench-venvs/llama-cpp"
LD_PRELOAD="$("$main/.venv/bin/python" -m rewind.blas --preload-value)"
export LD_PRELOAD
bench() { "$main/.venv/bin/python" -m rewind bench "$@" --out "$main/benchmarks/results"; }
case "${1:-all}" in
  agentic|all)
    # Full size: 2 sessions x 12 turns, 2k-token system prompt with tools, to 8.8k tokens.
    # One repeat: mlx-lm and llama.cpp take ~12 minutes each (they recompute most of every prompt).
    # Measured at 2fc3337; its llama.cpp row was dropped (streams cut by --interrupt_requests,
    # fixed in cfae4df), and llama.cpp ran again on its own at cfae4df:
    bench agentic --servers rewind,rewind-nocache,mlx-lm,llama.cpp --repeats 1
    bench agentic --servers llama.cpp --tag llama.cpp --repeats 1 ;;&
  qa|all)
    bench multi-round-qa --servers rewind,rewind-nocache,mlx-lm,llama.cpp --repeats 2 ;;&
  memory|all)
    bench long-prompts-memory --servers rewind,rewind-ram,mlx-lm,llama.cpp --repeats 1 ;;&
  parallel|all)
    # max_tokens cut from the 512 cap to 64: this base model never ends these chats itself.
    bench parallel-chat --servers rewind,mlx-lm,llama.cpp --max-tokens 64 --repeats 2 ;;&
  *) ;;
esac
