#!/usr/bin/env bash
# Build llama.cpp's CUDA llama-batched-bench and llama-server: the GPU baseline of
# `rewind bench decode-scaling --parts llama-cpp` (issue 27), from the same source as the CPU
# baseline (scripts/install-llama-cpp.sh: the llama.cpp tree vendored in the llama-cpp-python
# sdist). On a machine without a registry, unpack that tree there first (a tarball of it without
# its models/, docs/ and tests/ is ~11 MB) and name it:
#   LLAMA_CPP_SOURCE=/root/llama.cpp LLAMA_CPP_PREFIX=/root/llama-cuda bash scripts/llama-cpp-cuda.sh
# CUDA architectures: the card's own ("native", what a user building on that machine gets), or
# CUDA_ARCHS=90 for an H100/H200. Writes $prefix/bin and $prefix/VERSION; the build log is
# $prefix/build.log. About 5 minutes on 16 cores for one architecture. LLAMA_CMAKE_ARGS adds
# CMake options (split on spaces: no value may hold one): building here for another machine, say
# LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" (the CPU
# code is built for this machine's CPU otherwise, and AVX-512 faults on a host without it).
set -euo pipefail
source_dir="${LLAMA_CPP_SOURCE:?LLAMA_CPP_SOURCE=DIR: a llama.cpp tree}"
prefix="${LLAMA_CPP_PREFIX:-$HOME/.cache/rewind/llama-cpp-cuda}"
archs="${CUDA_ARCHS:-native}"
jobs="${JOBS:-$(nproc)}"
mkdir -p "$prefix/bin"
started=$(date +%s)
{
    cmake -S "$source_dir" -B "$prefix/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$archs" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
        ${LLAMA_CMAKE_ARGS:-}
    cmake --build "$prefix/build" --config Release -j "$jobs" \
        --target llama-batched-bench llama-server
} > "$prefix/build.log" 2>&1 || { tail -n 40 "$prefix/build.log" >&2; exit 1; }
cp "$prefix/build/bin/llama-batched-bench" "$prefix/build/bin/llama-server" "$prefix/bin/"
{
    cat "$source_dir/VENDORED_COMMIT" 2>/dev/null || echo "llama.cpp tree in $source_dir"
    "$prefix/bin/llama-server" --version 2>&1 | grep -E "^version:|^built with" || true
    echo "CUDA architectures: $archs; built in $(( $(date +%s) - started )) s with $jobs jobs"
} > "$prefix/VERSION"
cat "$prefix/VERSION"
