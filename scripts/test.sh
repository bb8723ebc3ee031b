#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The vision extra (mlx-vlm) and the router extra (sglang-router) are installed too, so their
# tests run instead of skipping.
REWIND_EXTRAS="${REWIND_EXTRAS:-dev,vision,router}" bash "$root/scripts/setup.sh"
cd "$root"
# The test process gets the same fast BLAS that the `rewind` command preloads for itself.
preload="$(.venv/bin/python -m rewind.blas --preload-value)"
set +e
LD_PRELOAD="$preload" .venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is not a failure of the code under test,
# but say so loudly.
if [ "$rc" = "5" ]; then echo "pytest collected no tests"; rc=0; fi
[ "$rc" = "0" ] || exit "$rc"

# Every machine runs the kernels' AVX2 build: on an AVX-512 CPU the suite above ran the AVX-512
# one, so the tests of the kernels and of the paths that call them run again as AVX2 (issue 23).
# Skipped when pytest was given arguments of its own (a chosen subset) or REWIND_NO_AVX512 is set.
# The native stress test (streams, cancellations, unloads: lifecycles the build does not change)
# runs once, above, since CI neared its 20 minutes; `bash scripts/sanitize.sh` runs it too. So do
# the default model's mixed-step equivalences (~55 s as AVX2; they test the scheduling, which the
# build does not change): the AVX2 kernels its GGUF blocks run are tested here on the tiny models
# (test_quant_kernels, test_gguf_in_place) and against the other builds (test_kernel_isas) above.
# Left out too: the test that runs every build, each in a process of its own, whatever this
# pass sets (it ran above; ~7 s), and pipelined decode's answers (when tokens are read:
# scheduling, ~11 s).
only_flags=1
for arg in "$@"; do case "$arg" in -*) ;; *) only_flags=0 ;; esac; done
if [ "$only_flags" = "1" ] && [ -z "${REWIND_NO_AVX512:-}" ] \
    && .venv/bin/python -c 'import sys; from rewind.kernels import native; sys.exit("avx512" not in native.runnable_isas())'; then
  echo "[rewind test] the kernel tests again on the AVX2 build (REWIND_NO_AVX512=1)"
  set +e
  REWIND_NO_AVX512=1 LD_PRELOAD="$preload" .venv/bin/python -m pytest "$@" \
    tests/test_kernel_boundary.py tests/test_cpu_attention.py tests/test_cpu_gated_delta.py \
    tests/test_native_linear.py tests/test_native_forward.py tests/test_mixed_steps.py \
    tests/test_quant_kernels.py tests/test_gguf_in_place.py tests/test_mlx_layers_batching.py \
    tests/test_linear_steps.py \
    --deselect "tests/test_mixed_steps.py::test_mixed_and_cached_give_the_alone_logits[default-layer-slices]" \
    --deselect "tests/test_mixed_steps.py::test_mixed_and_cached_give_the_alone_logits[default-gguf-layer-slices]" \
    --deselect "tests/test_mixed_steps.py::test_mixed_and_cached_give_the_alone_logits[default-whole-chunks]" \
    --deselect "tests/test_mixed_steps.py::test_mixed_and_cached_give_the_alone_logits[default-gguf-whole-chunks]" \
    --deselect tests/test_gguf_in_place.py::test_every_kernel_build_gives_the_same_logits \
    --deselect tests/test_mixed_steps.py::test_pipelined_decode_gives_the_unpipelined_answers
  rc=$?
  set -e
fi
exit "$rc"
