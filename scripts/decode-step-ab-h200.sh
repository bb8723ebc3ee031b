#!/usr/bin/env bash
# Call 2 on the H200: join and install the wheels staged by call 1 in /root/stage, then the A/B.
set -u
T0=$(date +%s)
END=$((T0 + ${BUDGET:-520}))
OUT=${OUT:-/tmp/q18out}; mkdir -p "$OUT"
cat /root/stage/cuda.part.aa tmp/wt18g/.gpu2/cuda.part.ab > /tmp/$(cat /root/stage/CUDA_WHEEL_NAME)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  /tmp/mlx_cuda_13-*.whl /root/stage/*.whl 2>&1 | tail -3
echo "install done after $(( $(date +%s) - T0 )) s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader; nproc; uptime
export PYTHONUNBUFFERED=1
Q=$PWD/tmp/q18
run() {  # label src cap args...
  local label=$1 src=$2 cap=$3; shift 3
  local now=$(date +%s); local dl=$(( now + cap < END ? now + cap : END ))
  [ $(( dl - now )) -lt 40 ] && { echo "skip $label"; return; }
  echo "== $label ($(( dl - now )) s)"
  PYTHONPATH=/tmp/site:$Q/$src/src timeout $(( dl - now + 15 )) python3 $Q/exp.py --label $label \
    --deadline $dl --json $OUT/$label.json "$@" 2>&1 | grep -v "^W\|Warning\|warn" | tee $OUT/$label.log | cut -c1-1500
}
run new-qwen new 230 --model qwen3.5-0.8b --modes on,off --reps 2 --parts bias,greedy --mlx-lm --trace on,off --micro
run old-qwen old 120 --model qwen3.5-0.8b --modes default --reps 2 --parts bias,greedy --trace default
run new-llama new 110 --model llama-3.2-1b --modes on,off --reps 1 --parts bias,greedy --trace on,off
echo "all done after $(( $(date +%s) - T0 )) s"
