#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: OpenBLAS (where apt and root allow), a virtual
# environment in .venv, and Rewind installed into it in editable mode. Safe to run again:
# each step is skipped when already done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${REWIND_EXTRAS:-dev}"

say() { printf '[rewind setup] %s\n' "$*" >&2; }

# 1. Fast BLAS. mlx[cpu] bundles a reference BLAS (~4 GFLOP/s); Debian's OpenBLAS, preloaded by
#    the `rewind` command, is 15-30x faster for float32 matmuls.
if [ "$(uname -s)" = "Linux" ]; then
  if ! ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      say "installing libopenblas0-pthread (fast BLAS for MLX on the CPU)"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
        || say "could not install libopenblas0-pthread: Rewind will run on MLX's slow reference BLAS"
    else
      say "OpenBLAS is not installed and this user cannot apt-get install it:"
      say "  ask an admin for 'apt-get install libopenblas0-pthread'; until then prefill is 5-8x slower."
    fi
  fi
fi

# 2. A Python >= 3.11 for the virtual environment.
py=""
for cand in python3.13 python3.12 python3.11 python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py="$cand"; break
  fi
done
[ -n "$py" ] || { say "Python 3.11 or newer is required"; exit 1; }

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $py"
  "$py" -m venv .venv
fi

# 3. Install (again) only when pyproject.toml or the extras changed.
stamp=".venv/.rewind-installed"
want="$(cat pyproject.toml | sha256sum | cut -c1-16)-$extras"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "installing rewind-engine[$extras] into .venv (about a minute)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # This machine's pip config names local mirrors that may be absent: drop that noise only.
  .venv/bin/python -m pip install -q -e ".[$extras]" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
  [ "${PIPESTATUS[0]}" = "0" ] || { say "pip install failed"; exit 1; }
  echo "$want" > "$stamp"
fi
