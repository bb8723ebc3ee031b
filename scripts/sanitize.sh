#!/usr/bin/env bash
# The sanitizer job (issue 23): the C kernels built with AddressSanitizer + UndefinedBehavior-
# Sanitizer (REWIND_SANITIZE=address), their runtimes preloaded so MLX's and NumPy's allocations
# are tracked too, under the kernel tests, the mixed-step and speculation equivalence tests, load
# and unload while streaming, and the threaded server stress; then the pool's ThreadSanitizer test. Any sanitizer
# report fails the job. (The RSS churn test is left out: ASan's shadow memory and quarantine are
# RSS that is not Rewind's.) Run it before every stop (it takes ~10 minutes on 2 cores, too long for
# CI beside the suite): `bash scripts/sanitize.sh`. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REWIND_EXTRAS="${REWIND_EXTRAS:-dev}" bash "$root/scripts/setup.sh"
cd "$root"

cc="${CC:-cc}"
asan="$("$cc" -print-file-name=libasan.so)"
ubsan="$("$cc" -print-file-name=libubsan.so)"
for lib in "$asan" "$ubsan"; do
  [ -f "$lib" ] || { echo "sanitize: $cc has no $(basename "$lib") (install gcc's sanitizer runtimes)" >&2; exit 1; }
done

reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
echo "[sanitize] ASan + UBSan build of the kernels; reports go to $reports"
set +e
REWIND_SANITIZE=address \
LD_PRELOAD="$asan $ubsan" \
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$reports/asan" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan" \
  .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/test_kernel_boundary.py tests/test_kernel_isas.py tests/test_cpu_attention.py \
    tests/test_cpu_gated_delta.py tests/test_native_linear.py tests/test_native_forward.py \
    tests/test_mixed_steps.py tests/test_model_pool.py tests/test_native_stress.py \
    tests/test_quant_kernels.py tests/test_gguf_in_place.py tests/test_speculation.py \
    tests/test_mlx_layers_batching.py tests/test_linear_steps.py \
    --deselect tests/test_model_pool.py::test_rss_stays_under_the_budget_over_a_load_unload_churn \
    "$@"
rc=$?
set -e
found=0
for report in "$reports"/*; do
  [ -e "$report" ] || continue
  found=1
  echo "[sanitize] report $(basename "$report"):"
  head -60 "$report"
done
if [ "$rc" != 0 ] || [ "$found" = 1 ]; then
  echo "[sanitize] FAILED (pytest exit $rc, sanitizer reports: $found)"
  exit 1
fi

echo "[sanitize] ThreadSanitizer: the kernels' thread pool"
.venv/bin/python -m pytest -p no:cacheprovider -q tests/test_native_pool.py
echo "[sanitize] 0 sanitizer reports"
