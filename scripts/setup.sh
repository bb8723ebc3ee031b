#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: OpenBLAS (where apt and root allow), a virtual
# environment in .venv, and Rewind installed into it in editable mode. Safe to run again:
# each step is skipped when already done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${REWIND_EXTRAS:-dev}"
# MLX's backend on Linux is an extra: cpu unless cuda is asked for (REWIND_EXTRAS=cuda,dev).
# Never both: the two wheels write the same mlx/lib/libmlx.so.
backend=""; other_backend=""
if [ "$(uname -s)" = "Linux" ]; then
  case ",$extras," in
    *,cuda,*) backend=cuda; other_backend=cpu ;;
    *) backend=cpu; other_backend=cuda ;;
  esac
  if [[ ",$extras," == *",$other_backend,"* ]]; then
    echo "[rewind setup] REWIND_EXTRAS names both cpu and cuda: MLX takes one backend, pick one" >&2
    exit 1
  fi
  extras="$extras,$backend"
fi

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

# 1b. A browser for the web page's test (tests/test_web_page.py, which skips without one):
#     Debian's Chromium and its chromedriver, only where the dev extra is wanted.
if [ "$(uname -s)" = "Linux" ] && [[ ",$extras," == *",dev,"* ]]; then
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      say "installing chromium and chromium-driver (the web page's browser test)"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
        || say "could not install chromium: the web page's browser test will be skipped"
    else
      say "chromium and chromedriver are not installed and this user cannot apt-get install them:"
      say "  the web page's browser test will be skipped ('apt-get install chromium chromium-driver')."
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

# A set-up interrupted while creating the venv leaves one without pip: make it anew.
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  say "creating .venv with $py"
  "$py" -m venv --clear .venv
fi

# 3. Install (again) only when pyproject.toml changed or an extra is asked for that is not there yet;
#    extras already installed are kept, so the serve and test commands never undo each other.
stamp=".venv/.rewind-installed"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
have_hash=""; have_extras=""
[ -f "$stamp" ] && read -r have_hash have_extras < "$stamp" || true
# A backend switch: the other backend's extra is not kept from the last install.
[ -z "$other_backend" ] || have_extras="$(printf '%s\n' ${have_extras//,/ } | grep -vx "$other_backend" | paste -sd, -)"
union="$(printf '%s\n' ${extras//,/ } ${have_extras//,/ } | sort -u | paste -sd, -)"
if [ "$have_hash" != "$hash" ] || [ "$union" != "$have_extras" ]; then
  [ "$have_hash" = "$hash" ] || union="$(printf '%s\n' ${extras//,/ } | sort -u | paste -sd, -)"
  say "installing rewind-engine[$union] into .venv (a few minutes on a fresh machine)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # This machine's pip config names local mirrors that may be absent: drop that noise only.
  .venv/bin/python -m pip install -q -e ".[$union]" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
  [ "${PIPESTATUS[0]}" = "0" ] || { say "pip install failed"; exit 1; }
  echo "$hash $union" > "$stamp"
fi

# 4. One MLX backend, and its library on disk: a venv that had the other backend keeps that
#    package (pip does not remove it), and its libmlx may be the one left on disk.
if [ -n "$backend" ]; then
  other_package="$([ "$backend" = cuda ] && echo mlx-cpu || echo mlx-cuda-13)"
  if .venv/bin/python -m pip show "$other_package" >/dev/null 2>&1; then
    ours="$([ "$backend" = cuda ] && echo mlx-cuda-13 || echo mlx-cpu)"
    version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx"))')"
    say "MLX backend: $backend; removing $other_package and unpacking $ours $version again"
    .venv/bin/python -m pip uninstall -q -y "$other_package"
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$ours==$version" 2>&1 \
      | { grep -v 'is ignored: it is neither' || true; }
  fi
  .venv/bin/python -m rewind.mlx_install >/dev/null || { .venv/bin/python -m rewind.mlx_install; exit 1; }
fi
