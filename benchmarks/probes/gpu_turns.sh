#!/usr/bin/env bash
# One GPU session's probes (run on the device from the repository root, after the wheels are
# staged as ../shared/GPU.md says and PYTHONPATH=/tmp/site:$PWD/src): what a new shape costs,
# the served turn latencies of server processes in a row, which libmlx.so a clean virtual
# environment ends with, and (PART=attention) the decode attention kernel against MLX's, then the
# in-engine cached turn. Writes under $OUT.
#   PART=shapes|turns|install|attention|host|compiled|engine-compiled|sanitize|restore|all  TESTS="tests/..."  INSTALL_TEST=1  RUNS=empty/warm-up,...
set -u
out="${OUT:-/tmp/out}"; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" >> "$out/gpu.txt" 2>&1
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx-probe}"
part="${PART:-all}"
if [ "$part" = all ] || [ "$part" = shapes ]; then
  python3 benchmarks/probes/new_shapes.py --json "$out/new-shapes.json" > "$out/new-shapes.txt" 2>&1
  tail -n 40 "$out/new-shapes.txt"
  if [ -n "${TESTS:-}" ]; then
    python3 -m pytest -q -p no:cacheprovider $TESTS > "$out/tests.txt" 2>&1; tail -n 15 "$out/tests.txt"
  fi
fi
if [ "$part" = all ] || [ "$part" = restore ]; then
  # a prompt-cache restore of Llama-3.2-1B's KV layout, per layer and joined (rewind.cache.records)
  python3 benchmarks/probes/restore_cost.py ${LENGTHS:+--lengths "$LENGTHS"} > "$out/restore-cost.txt" 2>&1
  tail -n 12 "$out/restore-cost.txt"
fi
if [ "$part" = all ] || [ "$part" = turns ]; then
  python3 benchmarks/probes/turn_latency.py --shape "${SHAPE:-qwen3.5-0.8b}" \
    ${RUNS:+--runs "$RUNS"} --json "$out/turn-latency.json" > "$out/turn-latency.txt" 2>&1
  tail -n 20 "$out/turn-latency.txt"
fi
if [ "$part" = attention ]; then
  # Rewind's decode attention for rows of mixed lengths against MLX's masked and unmasked
  # attention, one layer (rewind.kernels.cuda_attention), then the in-engine cached turn.
  python3 benchmarks/probes/sdpa_mask_cost.py --json "$out/sdpa-mask-cost.json" > "$out/sdpa-mask-cost.txt" 2>&1
  tail -n 8 "$out/sdpa-mask-cost.txt"
  python3 benchmarks/probes/cached_turn_profile.py --shape "${SHAPE:-qwen3.5-0.8b}" \
    --json "$out/cached-turn-profile.json" > "$out/cached-turn-profile.txt" 2>&1
  head -n 4 "$out/cached-turn-profile.txt"
fi
if [ "$part" = host ]; then
  # MLX alone (mlx and mlx-lm, no Rewind): a decode step's host time per MLX_MAX_OPS_PER_BUFFER,
  # the minimal reproduction docs/HARDWARE.md names for MLX upstream.
  # each of SETTINGS in a child process: "default" or NAME=VALUE[,NAME=VALUE]
  python3 benchmarks/probes/mlx_step_host_cost.py --batches ${BATCHES:-1 8 32} \
    --settings ${SETTINGS:-default MLX_MAX_OPS_PER_BUFFER=20 MLX_MAX_OPS_PER_BUFFER=250 MLX_USE_CUDA_GRAPHS=0} \
    --json "$out/mlx-step-host-cost.json" > "$out/mlx-step-host-cost.txt" 2>&1
  tail -n 40 "$out/mlx-step-host-cost.txt"
fi
if [ "$part" = compiled ]; then
  # a fixed-shape decode step, plain and under mx.compile, against mlx-lm's (Llama-3.2-1B shape)
  python3 benchmarks/probes/compiled_step.py --batches ${BATCHES:-1 8 32} \
    --json "$out/compiled-step.json" > "$out/compiled-step.txt" 2>&1
  tail -n 12 "$out/compiled-step.txt"
fi
if [ "$part" = engine-compiled ]; then
  # the engine's decode step plain and compiled (REWIND_COMPILED_DECODE off, on), each stream count
  # side by side in one process, then over HTTP
  python3 -m rewind bench decode-scaling --models ${MODELS:-llama-3.2-1b} --parts uncompiled compiled ${HTTP:+http} \
    ${COMMIT:+--commit $COMMIT} --json "$out/decode-scaling-compiled.json" > "$out/decode-scaling-compiled.txt" 2>&1
  grep -E "^\|" "$out/decode-scaling-compiled.md" | head -n 8
fi
if [ "$part" = sanitize ]; then
  # compute-sanitizer's memcheck and racecheck on Rewind's attention kernel only (MLX's own
  # kernels are not checked), through its CUDA tests
  sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  for tool in memcheck racecheck; do
    "$sanitizer" --tool "$tool" --error-exitcode 9 --kernel-name kns=rewind_decode_attention \
      python3 -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py -k "not mixed_length" \
      > "$out/sanitize-$tool.txt" 2>&1
    echo "$tool exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$out/sanitize-$tool.txt" | tail -n 3
  done
fi
if [ -n "${INSTALL_TEST:-}" ] && { [ "$part" = all ] || [ "$part" = turns ] || [ "$part" = install ]; }; then
  (
    links="--no-index --find-links /root/stage --find-links .gpu2/extra"
    report() { env PYTHONPATH="$PWD/src" "$1/bin/python" -m rewind.mlx_install;
               env -u PYTHONPATH "$1/bin/python" -c "import mlx.core as mx; print('mx.cuda.is_available():', mx.cuda.is_available(), mx.default_device())"; }
    fresh() { rm -rf "$1" && python3 -m venv --system-site-packages "$1"; }
    # pip resolves the NVIDIA libraries from the system's site-packages (the CUDA PyTorch there);
    # where it cannot, the same wheels go in without their dependencies.
    # Without PYTHONPATH: pip would count the packages under /tmp/site as installed here.
    install() { local v="$1"; shift; env -u PYTHONPATH "$v/bin/pip" install -q $links "$@" ||
                env -u PYTHONPATH "$v/bin/pip" install -q $links --no-deps "$@"; }
    echo "== [cuda] now: mlx[cuda13] alone"; fresh /tmp/iv-a; install /tmp/iv-a 'mlx[cuda13]==0.32.4' mlx-cuda-13==0.32.4; report /tmp/iv-a
    echo "== before: mlx[cpu] hard plus the cuda extra, one pip transaction"; fresh /tmp/iv-b; install /tmp/iv-b 'mlx[cpu,cuda13]==0.32.4' mlx-cpu==0.32.4 mlx-cuda-13==0.32.4; report /tmp/iv-b
    echo "== mlx-cpu installed later into the [cuda] venv"; install /tmp/iv-a mlx-cpu==0.32.4; report /tmp/iv-a
    echo "== the fix rewind.mlx_install prints"; env -u PYTHONPATH /tmp/iv-a/bin/pip uninstall -q -y mlx-cpu && install /tmp/iv-a --force-reinstall --no-deps mlx-cuda-13==0.32.4; report /tmp/iv-a
  ) > "$out/install.txt" 2>&1
  cat "$out/install.txt" | grep -v "^WARNING" | tail -n 40
fi
