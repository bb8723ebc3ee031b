#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` and `llama-bench` from source into .bench-venvs/llama-cpp/,
# the baseline the side-by-side benchmarks compare Rewind with. Users run llama-server itself, not
# a Python wrapper, so that is what the bench runs (issue 12).
#
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI: PyPI is the one
# source this project's machines can always reach, and the sdist pins one llama.cpp commit, the
# same the Python package ships. The version is written to $prefix/VERSION for the bench's reports.
#
# GGML_NATIVE=ON: the binaries run only on the machine that built them, so -march=native gives
# llama.cpp every SIMD extension this CPU has; a fair baseline. About 12 minutes on 2 cores.
# Idempotent: does nothing when both binaries already exist. Never run in CI.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${LLAMA_CPP_PREFIX:-$repo_root/.bench-venvs/llama-cpp}"
python="${PYTHON:-python3}"
if [[ -x "$repo_root/.venv/bin/python" ]]; then
    python="$repo_root/.venv/bin/python"
fi

if [[ -x "$prefix/bin/llama-server" && -x "$prefix/bin/llama-bench" && -f "$prefix/VERSION" ]]; then
    echo "llama-server and llama-bench already built in $prefix/bin ($(tr '\n' ' ' < "$prefix/VERSION"))"
    exit 0
fi

mkdir -p "$prefix/src" "$prefix/bin"
started=$(date +%s)

echo "[1/4] Downloading the llama-cpp-python sdist (for its vendored llama.cpp)..."
sdist_dir="$prefix/src/sdist"
rm -rf "$sdist_dir" && mkdir -p "$sdist_dir"
"$python" -m pip download --quiet --no-binary :all: --no-deps llama-cpp-python -d "$sdist_dir"
sdist="$(ls "$sdist_dir"/llama_cpp_python-*.tar.gz | head -1)"
sdist_name="$(basename "$sdist" .tar.gz)"
echo "      $sdist_name"

echo "[2/4] Unpacking..."
tar -xzf "$sdist" -C "$sdist_dir"
source_dir="$sdist_dir/$sdist_name/vendor/llama.cpp"
if [[ ! -f "$source_dir/CMakeLists.txt" ]]; then
    echo "no vendor/llama.cpp in $sdist_name" >&2
    exit 1
fi

echo "[3/4] Configuring with CMake (Release, native CPU flags, server on, curl off)..."
build_dir="$prefix/src/build"
cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    > "$prefix/src/cmake-configure.log"

jobs="$(nproc)"
echo "[4/4] Building llama-server and llama-bench with $jobs jobs (about 12 minutes on 2 cores)..."
# Static libraries so the two binaries can be copied into bin/ with nothing else beside them.
# cmake's own "[ NN%]" lines are the progress report.
cmake --build "$build_dir" --config Release -j "$jobs" --target llama-server llama-bench 2>&1 \
    | grep --line-buffered -E "^\[ *[0-9]+%\]|error|Error" || true
for binary in llama-server llama-bench; do
    if [[ ! -x "$build_dir/bin/$binary" ]]; then
        echo "$binary was not built; see the output above" >&2
        exit 1
    fi
    cp "$build_dir/bin/$binary" "$prefix/bin/$binary"
done

# The version the bench reports: the sdist's name pins the llama-cpp-python release, the vendored
# tree's git metadata (shipped in the sdist) the llama.cpp commit, and llama-server --version what
# the binary says of itself.
{
    echo "$sdist_name"
    echo "llama.cpp commit $(git -C "$source_dir" rev-parse HEAD 2>/dev/null || echo unknown)"
    "$prefix/bin/llama-server" --version 2>&1 | grep -E "^version:" || true
} > "$prefix/VERSION"
elapsed=$(( $(date +%s) - started ))
echo "Built llama-server and llama-bench in $prefix/bin in ${elapsed}s ($(tr '\n' ' ' < "$prefix/VERSION"))"
