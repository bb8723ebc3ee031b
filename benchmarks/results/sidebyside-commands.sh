#!/usr/bin/env bash
# The commands that produced the results in this folder on the AMD EPYC (2 cores, AVX-512)
# machine of 2026-12-03, run one after another (never two at once, nothing else running).
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
out="${BENCH_OUT:-$main/benchmarks/results}"
cd "$tree"
export PYTHONPATH="$tree/src" LLAMA_CPP_VENV="$main/.bench-venvs/llama-cpp"
LD_PRELOAD="$("$main/.venv/bin/python" -m rewind.blas --preload-value)"
export LD_PRELOAD
rewind() { "$main/.venv/bin/python" -m rewind "$@"; }
bench() { rewind bench "$@" --out "$out"; }
case "${1:-all}" in
  speed|all)
    # One sequence on the default model: Rewind (bf16 weights through the C kernels; and int8),
    # mlx-lm as stored and as a float32 copy, llama.cpp on the GGUF.
    # Three rounds, rows in turn within each, medians (measured at 3e7c726; the rest at d42df15).
    rewind bench speed --prompt-tokens 1024 --gen-tokens 64 --mlx-lm-float32 --also-int8 \
      --llama-cpp --repeats 3 --json "$out/speed.json"
    # An agent's next turn: 512 new tokens after 8,192 already in the cache.
    rewind bench speed --prompt-tokens 512 --gen-tokens 32 --context 8192 --mlx-lm-float32 \
      --llama-cpp --json "$out/speed-context-8k.json"
    REWIND_NO_OPENBLAS=1 LD_PRELOAD= rewind bench speed --prompt-tokens 1024 --gen-tokens 64 \
      --mlx-lm-float32 --json "$out/speed-no-openblas.json" ;;&
  agentic|all)
    # Full size: 2 sessions x 12 turns, 2k-token system prompt with tools, to 8.8k tokens.
    bench agentic --servers rewind,rewind-nocache,mlx-lm,llama.cpp --repeats 1 ;;&
  qa|all)
    bench multi-round-qa --servers rewind,rewind-nocache,mlx-lm,llama.cpp --repeats 2 ;;&
  memory|all)
    bench long-prompts-memory --servers rewind,rewind-ram,mlx-lm,llama.cpp --repeats 1 ;;&
  parallel|all)
    # max_tokens cut from the 512 cap to 64: this base model never ends these chats itself.
    bench parallel-chat --servers rewind,mlx-lm,llama.cpp --max-tokens 64 --repeats 2 ;;&
  startup|all)
    # Start-up to /health and to the first answer (every side-by-side run records it; this one
    # at 5eb0580+, after the tokenizer is parsed once).
    bench parallel-chat --servers rewind,mlx-lm,llama.cpp --max-tokens 64 --repeats 2 --tag startup ;;&
  cache|all)
    rewind bench prompt-cache --baseline-turns 1,10 --out "$out" ;;&
  *) ;;
esac
