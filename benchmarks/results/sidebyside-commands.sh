#!/usr/bin/env bash
# The commands that produced the side-by-side results in this folder (agentic, long-prompts-memory,
# parallel-chat, multi-round-qa). Sizes are cut down from the issue's full spec (2k-token system
# prompt, sessions growing past 8k tokens, 4k-token prompts) because the 2-core machine was shared
# with several other jobs (load average 12-15) while these ran; the full-size commands are the
# workloads' defaults: `rewind bench agentic`, `rewind bench long-prompts-memory`, ...
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-all}" in
  agentic|all)
    .venv/bin/rewind bench agentic --servers rewind,mlx-lm,rewind-nocache --sessions 1 --turns 5 \
        --system-tokens 600 --tool-tokens 250 --answer-tokens 60 --max-tokens 16 --repeats 1 ;;&
  memory|all)
    .venv/bin/rewind bench long-prompts-memory --servers rewind,rewind-ram,mlx-lm \
        --prompt-tokens 1500 --max-tokens 8 --repeats 1 ;;&
  parallel|all)
    .venv/bin/rewind bench parallel-chat --servers rewind,mlx-lm --max-tokens 128 --repeats 1 ;;&
  qa|all)
    .venv/bin/rewind bench multi-round-qa --servers rewind,rewind-nocache,mlx-lm --users 2 --rounds 3 \
        --system-tokens 300 --history-tokens 300 --question-tokens 40 --max-tokens 16 --repeats 1 ;;&
  llama|all)
    .venv/bin/rewind bench agentic --servers llama.cpp --tag llama.cpp --sessions 1 --turns 5 \
        --system-tokens 600 --tool-tokens 250 --answer-tokens 60 --max-tokens 16 --repeats 1
    .venv/bin/rewind bench long-prompts-memory --servers llama.cpp --tag llama.cpp \
        --prompt-tokens 1500 --max-tokens 8 --repeats 1
    .venv/bin/rewind bench parallel-chat --servers llama.cpp --tag llama.cpp --max-tokens 128 \
        --repeats 1 ;;&
  *) ;;
esac
