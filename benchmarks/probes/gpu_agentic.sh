#!/usr/bin/env bash
# Issue 27 on a lent GPU machine: `rewind bench agentic`, three agent sessions at once, end to end
# against llama.cpp's CUDA llama-server, both on the same random Llama-3.2-1B-shape weights (a bf16
# folder for Rewind, the same values as an F16 GGUF for llama-server; the machine has no weights
# to fetch, and speed does not depend on the values). Run from the repository root once MLX's
# CUDA wheels are under /tmp/site (shared/GPU.md) and scripts/llama-cpp-cuda.sh built llama.cpp
# into $LLAMA_CPP_PREFIX (with LLAMA_CPP_SOURCE set and no llama-server there, this script builds
# it first: ~5 minutes on 16 cores):
#   LLAMA_CPP_PREFIX=/root/llama-cuda PYTHONPATH=/tmp/site:$PWD/src bash benchmarks/probes/gpu_agentic.sh
# Writes under $OUT: agentic-<TAG>.md and .json (the TTFT plot too where matplotlib is installed),
# setup.txt (the card, MLX's device, llama.cpp's VERSION, what llama-server's log says of the GPU),
# bench.txt (the bench's output) and logs/ (each server's log).
# The random model's tokenizer makes ~2.5x more tokens of the same text than a real one: the text
# sizes are the defaults x 0.4, so the prompts grow from ~2.5k to ~9k tokens as the bench intends.
# SESSIONS (3), TURNS (12), REPEATS (2), MAX_TOKENS (32), SERVERS (rewind,llama.cpp), SHAPE
# (llama-3.2-1b), TAG, WORK_DIR, BENCH_TIMEOUT (540 s) override. STEP_LOG (any non-empty
# value) runs Rewind with --log-level debug and writes slow-steps.txt: its engine steps over
# 30 ms, each with its decode rows, prefill work and whether it traced a new compiled shape (the
# server logs themselves may be too many files to come back from a lent machine). A line a
# step is logged then: such a run's timings are not the plain run's. ALLOW_CPU=1 lets MLX run on the
# CPU: a rehearsal, e.g. SESSIONS=2 TURNS=2 REPEATS=1 MAX_TOKENS=8 against a CPU llama-server
# (~5 minutes on 2 cores).
set -uo pipefail
out="${OUT:-/tmp/out}"; mkdir -p "$out/logs"
export LLAMA_CPP_PREFIX="${LLAMA_CPP_PREFIX:-/root/llama-cuda}" PYTHONUNBUFFERED=1
python="${PYTHON:-python3}"
if [ ! -x "$LLAMA_CPP_PREFIX/bin/llama-server" ] && [ -n "${LLAMA_CPP_SOURCE:-}" ]; then
  bash scripts/llama-cpp-cuda.sh || exit 1
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  echo "llama.cpp ($LLAMA_CPP_PREFIX/VERSION):"; cat "$LLAMA_CPP_PREFIX/VERSION" 2>&1
} > "$out/setup.txt"
# Everything the run needs, checked in seconds before minutes of device time: a missing module
# or a llama-server the bench would skip fails here, loudly.
"$python" - >> "$out/setup.txt" 2>&1 <<'EOF' || { cat "$out/setup.txt"; exit 1; }
import gguf, httpx, openai, psutil, tqdm  # noqa: F401  (the bench's and the GGUF writer's)
import mlx.core as mx
import rewind.commands.serve  # noqa: F401  (rewind serve's own imports)
from rewind.bench.servers import LLAMA_SERVER, llama_cpp_installed, llama_cpp_version
import os
print("mlx", mx.__version__, mx.default_device())
assert mx.default_device() == mx.gpu or os.environ.get("ALLOW_CPU"), "MLX is not on the GPU"
assert llama_cpp_installed(LLAMA_SERVER), "llama-server not built in LLAMA_CPP_PREFIX"
print("llama.cpp as the report names it:", llama_cpp_version())
EOF
cat "$out/setup.txt"
logs="${TMPDIR:-/tmp}/rewind-bench-logs"  # where the bench writes its servers' logs
touch "$out/.started"
timeout "${BENCH_TIMEOUT:-540}" "$python" -m rewind bench agentic \
  --random-model "${SHAPE:-llama-3.2-1b}" --work-dir "${WORK_DIR:-/tmp/rewind-random-models}" \
  --servers "${SERVERS:-rewind,llama.cpp}" --sessions "${SESSIONS:-3}" --turns "${TURNS:-12}" \
  --repeats "${REPEATS:-2}" --max-tokens "${MAX_TOKENS:-32}" \
  --system-tokens 800 --tool-tokens 180 --answer-tokens 48 \
  --out "$out" --tag "${TAG:-gpu-random}" \
  ${STEP_LOG:+--rewind-arg=--log-level=debug} > "$out/bench.txt" 2>&1
status=$?
find "$logs" -name '*.log' -newer "$out/.started" -exec cp {} "$out/logs/" \; 2>/dev/null
if [ -n "${STEP_LOG:-}" ]; then
  "$python" - "$out"/logs/rewind-*.log > "$out/slow-steps.txt" 2>&1 <<'EOF'
import re, sys
timed = re.compile(r"step \d+.*?: .*?, ([0-9.]+) ms \(schedule")
for path in sys.argv[1:]:
    lines = [line.rstrip() for line in open(path, errors="replace") if timed.search(line)]
    slow = [line for line in lines if float(timed.search(line).group(1)) > 30]
    traced = sum("traced a new compiled" in line for line in lines)
    print(f"== {path}: {len(lines)} steps, {len(slow)} over 30 ms, {traced} traced a new shape")
    print("\n".join(slow[:400]))
EOF
  grep "^==" "$out/slow-steps.txt"
fi
grep -h -i -E "offload|cuda|gpu" "$out"/logs/llama.cpp-*.log 2>/dev/null | head -n 4 >> "$out/setup.txt"
grep -h "warmed up" "$out"/logs/rewind-*.log 2>/dev/null >> "$out/setup.txt"  # start-up's parts
grep -v -E "turn/s|it/s\]" "$out/bench.txt" | tail -n 15
report="$out/agentic-${TAG:-gpu-random}.md"
[ -f "$report" ] && sed -n '/^### Whole run/,/^### Start-up/p' "$report" | grep -E "^\|"
tail -n 5 "$out/setup.txt"
echo "bench exit $status"
exit $status
