#!/usr/bin/env bash
# The commands that produced the side-by-side results in this folder (speed*, agentic-*,
# multi-round-qa, long-prompts-memory, parallel-chat), run one after another on the AMD EPYC
# (2 cores, AVX-512) machine, from the repository root of a checkout of the measured commit (the
# servers the bench starts inherit PYTHONPATH; each result records rewind_commit, the load
# average and each server's command line).
#
# llama.cpp is llama.cpp's own llama-server and llama-bench, built from source once by
#   bash scripts/install-llama-cpp.sh      # -> .bench-venvs/llama-cpp/{bin,VERSION}
# (the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist; VERSION names the commit).
#
# PYTHON: the interpreter of an environment with rewind's dependencies (scripts/setup.sh makes
# .venv); this checkout's src/ is what runs.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
python="${PYTHON:-$repo/.venv/bin/python}"
export PYTHONPATH="$repo/src"
LD_PRELOAD="$("$python" -m rewind.blas --preload-value)"
export LD_PRELOAD
out=benchmarks/results
rewind() { "$python" -m rewind "$@"; }
bench() { rewind bench "$@" --out "$out"; }
case "${1:-all}" in
  speed|all)
    # One sequence on the default model: Rewind (exact bf16 weights through the C kernels; and
    # int8), mlx-lm as stored and as a float32 copy, llama.cpp's llama-bench on the GGUF.
    # Three rounds, rows in turn within each, medians.
    rewind bench speed --prompt-tokens 1024 --gen-tokens 64 --mlx-lm-float32 --also-int8 \
      --llama-cpp --repeats 3 --json "$out/speed.json"
    # An agent's next turn: 512 new tokens after 8,192 already in the cache (mlx-lm's rows left
    # out: its bf16 row prefills the untimed 8k context at ~15 tokens/s).
    rewind bench speed --prompt-tokens 512 --gen-tokens 32 --context 8192 --skip-mlx-lm \
      --llama-cpp --json "$out/speed-context-8k.json" ;;&
  agentic|all)
    # S sessions at once, 14 turns each, to 10.2k tokens, 32 tokens a turn (issues 12 and 18).
    bench agentic --servers rewind,llama.cpp,rewind-int8 --sessions 3 --turns 14 --repeats 1 \
      --tag 3-sessions
    bench agentic --servers rewind,llama.cpp,rewind-int8 --sessions 4 --turns 14 --repeats 1 \
      --tag 4-sessions ;;&
  parallel|all)
    # max_tokens cut from the 512 cap to 64: this base model never ends these chats itself.
    bench parallel-chat --servers rewind,llama.cpp,mlx-lm --max-tokens 64 --repeats 2 ;;&
  memory|all)
    bench long-prompts-memory --servers rewind,llama.cpp,rewind-ram,mlx-lm --repeats 1 ;;&
  qa|all)
    bench multi-round-qa --servers rewind,llama.cpp,rewind-nocache,mlx-lm --repeats 1 ;;&
  cache|all)
    rewind bench prompt-cache --baseline-turns 1,10 --out "$out" ;;&
  *) ;;
esac
