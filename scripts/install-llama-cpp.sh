#!/usr/bin/env bash
# Install llama-cpp-python[server] into its own virtual environment (.bench-venvs/llama-cpp),
# so the baseline never touches Rewind's own .venv. It builds llama.cpp from source: about
# 6 minutes on 2 cores. Used by `rewind bench ... --servers llama.cpp`; never run in CI.
#
# The build is portable: GGML_NATIVE=OFF keeps -march=native out (the wheel may run on another
# CPU of the same family), while AVX2/FMA/F16C are switched on explicitly since every x86-64
# machine this project targets has them; without them llama.cpp would fall back to scalar code
# and the comparison would be unfair to it.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LLAMA_CPP_VENV:-$repo_root/.bench-venvs/llama-cpp}"
python="${PYTHON:-python3}"
if [[ -x "$repo_root/.venv/bin/python" ]]; then
    # Same interpreter version as Rewind's venv; the venv itself stays separate.
    python="$(readlink -f "$repo_root/.venv/bin/python")"
fi

if [[ -x "$venv/bin/python" ]] && "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    echo "llama-cpp-python[server] already installed in $venv"
    exit 0
fi

echo "Installing llama-cpp-python[server] into $venv (builds llama.cpp from source, ~6 min on 2 cores)..."
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip wheel

cmake_args="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF"
case "$(uname -m)" in
    x86_64) cmake_args="$cmake_args -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
esac
export CMAKE_ARGS="${CMAKE_ARGS:-$cmake_args}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
echo "CMAKE_ARGS=$CMAKE_ARGS"

"$venv/bin/pip" install --verbose --no-cache-dir "llama-cpp-python[server]" 2>&1 \
    | grep --line-buffered -E "Building|Built|Successfully|error|Error|\[[ 0-9]+%\]" || true

if "$venv/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    echo "llama-cpp-python[server] installed in $venv"
else
    echo "llama-cpp-python[server] failed to install; see the output above" >&2
    exit 1
fi
