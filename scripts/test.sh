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
if [ "$rc" = "5" ]; then echo "pytest collected no tests"; exit 0; fi
exit "$rc"
