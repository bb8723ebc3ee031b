#!/usr/bin/env bash
# The H200 run of `rewind bench decode-scaling` (issue 18), on a lent GPU machine whose python3
# (3.12, CUDA torch) has MLX's CUDA wheels and the missing pure-Python packages installed under
# /tmp/site (shared/GPU.md says how). Results and logs go to $OUT.
#   MODELS="llama-3.2-1b qwen3.5-0.8b" PARTS="engine greedy mlx-lm kernels http" bash scripts/decode-scaling-h200.sh
set -uo pipefail
CODE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=/tmp/site:$CODE/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode-scaling-out}
mkdir -p "$OUT" /root/models
python3 -c "import mlx.core as mx, mlx_lm, torch; print(mx.default_device(), mx.__version__, torch.__version__)"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm,clocks.mem --format=csv
timeout "${BENCH_TIMEOUT:-540}" python3 -m rewind bench decode-scaling \
  --models ${MODELS:-llama-3.2-1b qwen3.5-0.8b} --parts ${PARTS:-engine greedy mlx-lm kernels http} \
  --deadline-s "${DEADLINE:-400}" --work-dir /root/models --commit "$(cat "$CODE/COMMIT" 2>/dev/null)" \
  --json "$OUT/decode-scaling-h200.json"
cp /root/models/*-kernels.json "$OUT/" 2>/dev/null
# Fallback when torch's profiler saw none of MLX's kernels: Nsight Compute on one case a process,
# kernel names only (attention-like kernels and the case markers around the traced step).
kernels=/root/models/llama-3.2-1b-kernels.json
if [ -f "$kernels" ] && ! grep -q '"profiler_saw_kernels": true' "$kernels"; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for case in 0 2 3 4; do
    timeout 90 "$NCU" --clock-control none --metrics gpu__time_duration.sum \
      --kernel-name "regex:(?i)marker|sdpa|cudnn|fmha|flash|softmax" \
      python3 -m rewind.bench.decode_kernels --model /root/models/llama-3.2-1b \
      --json "$OUT/ncu-case$case.json" --only-case "$case" > "$OUT/ncu-case$case.txt" 2>&1
    grep -E "marker|sdpa|cudnn|fmha|flash|softmax" "$OUT/ncu-case$case.txt" | grep -v "==PROF==" | cut -c1-160 | head -30
  done
fi
