#!/usr/bin/env bash
# Build llama.cpp's own `llama-server`, `llama-bench` and `llama-perplexity` from source into
# .bench-venvs/llama-cpp/, the baseline the side-by-side benchmarks compare Rewind with. Users run
# llama-server itself, not a Python wrapper, so that is what the bench runs (issue 12);
# `rewind bench perplexity --llama-cpp` compares Rewind's perplexity with llama-perplexity's on
# the same GGUF and text (issue 25).
#
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI: PyPI is the one
# source this project's machines can always reach, and the sdist pins one llama.cpp commit, the
# same the Python package ships. The version is written to $prefix/VERSION for the bench's reports.
# LLAMA_CPP_SOURCE=DIR builds a llama.cpp tree already on disk instead (no download).
#
# GGML_NATIVE=ON first: the binaries run only on the machine that built them, so -march=native
# gives llama.cpp every SIMD extension this CPU has; a fair baseline. About 12 minutes on 2 cores.
# Then the binaries are smoke-run here (src/rewind/bench/llama_cpp_build.py: versions, devices,
# and with the default model's GGUF a short llama-bench and one llama-server completion;
# llama-perplexity shares their libraries and kernels, and prints its version). If one
# dies with a signal, the build is redone with GGML_NATIVE=OFF and explicit flags for what
# /proc/cpuinfo lists, AMX off (issue 23: on a Xeon whose kernel does not grant AMX state, the
# native build died at start), and smoke-run again. Where the CPU lists AMX and the kernel
# refuses it up front, the explicit build is the first one. The flags used, and why, go to
# $prefix/BUILD_FLAGS, which the reports name; it is written only once a build passed its smoke
# run, and the bench takes the binaries as built only beside it.
#
# Idempotent: an existing build is smoke-run, and left alone only when it passes; one that fails
# is removed and rebuilt. An install from before this script built llama-perplexity gets it built
# in its existing build tree (cmake --build --target llama-perplexity: its own two sources and a
# link, seconds), then the smoke run; where that tree cannot build it, everything is rebuilt. Never run in CI. LLAMA_CPP_SMOKE_MODEL=GGUF picks the smoke run's model
# (empty: none, versions and devices only). LLAMA_CPP_EXPLICIT=1 skips GGML_NATIVE=ON and builds
# with explicit flags for what /proc/cpuinfo (or LLAMA_CPP_CPUINFO's file) lists.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${LLAMA_CPP_PREFIX:-$repo_root/.bench-venvs/llama-cpp}"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    python=python3
    if [[ -x "$repo_root/.venv/bin/python" ]]; then
        python="$repo_root/.venv/bin/python"
    fi
fi
build_py() { "$python" "$repo_root/src/rewind/bench/llama_cpp_build.py" "$@"; }

# The smoke run's model: the default model's GGUF (assembled once from its PyPI packages, the
# same file the bench runs llama.cpp on), where Rewind is importable.
smoke_model=""
resolve_smoke_model() {
    if [[ -n "$smoke_model" ]]; then
        return
    fi
    if [[ -n "${LLAMA_CPP_SMOKE_MODEL+set}" ]]; then
        smoke_model="${LLAMA_CPP_SMOKE_MODEL:-none}"
    else
        smoke_model="$(PYTHONPATH="$repo_root/src${PYTHONPATH:+:$PYTHONPATH}" "$python" -c \
            'from rewind.models.registry import default_gguf; print(default_gguf())' \
            2>/dev/null || echo none)"
    fi
    if [[ "$smoke_model" == none ]]; then
        echo "      (no GGUF for the smoke run: versions and devices only, no matmul runs)" >&2
    fi
}

# smoke BIN_DIR: sets smoke_status (0 passed, 3 died with a signal, else failed) and smoke_report
# (one line, "passed: ..." or what failed, then the failure's last output, if any).
smoke() {
    resolve_smoke_model
    smoke_status=0
    if [[ "$smoke_model" == none ]]; then
        smoke_report="$(build_py smoke "$1")" || smoke_status=$?
    else
        smoke_report="$(build_py smoke "$1" --model "$smoke_model")" || smoke_status=$?
    fi
}

binaries=(llama-server llama-bench llama-perplexity)
build_dir="$prefix/src/build"
jobs="$(nproc)"

# build_targets TARGETS...: builds them in the configured tree in $build_dir (cmake's own
# "[ NN%]" lines are the progress report); fails if one was not built.
build_targets() {
    cmake --build "$build_dir" --config Release -j "$jobs" --target "$@" 2>&1 \
        | grep --line-buffered -E "^\[ *[0-9]+%\]|error|Error" || true
    local binary
    for binary in "$@"; do
        if [[ ! -x "$build_dir/bin/$binary" ]]; then
            echo "$binary was not built; see the output above" >&2
            return 1
        fi
    done
}

# add_missing TARGETS...: builds binaries an existing install lacks in the tree that built it,
# with the flags it was configured with, and copies them into bin/. Fails where there is no such
# tree: none, or one copied from elsewhere (its Makefiles build in the folder it was configured
# in, not in this one).
add_missing() {
    local cache="$build_dir/CMakeCache.txt" configured
    if [[ ! -f "$cache" ]]; then
        echo "no configured build tree in $build_dir" >&2
        return 1
    fi
    configured="$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$cache")"
    if [[ -z "$configured" || "$(cd "$configured" 2>/dev/null && pwd -P)" != \
          "$(cd "$build_dir" && pwd -P)" ]]; then
        echo "the build tree in $build_dir was configured in $configured" >&2
        return 1
    fi
    echo "Building $* in the existing build tree ($build_dir)..."
    build_targets "$@" || return 1
    local binary
    for binary in "$@"; do
        cp "$build_dir/bin/$binary" "$prefix/bin/$binary"
    done
}

if [[ -x "$prefix/bin/llama-server" && -x "$prefix/bin/llama-bench" && -f "$prefix/VERSION" ]]; then
    missing=()
    for binary in "${binaries[@]}"; do
        [[ -x "$prefix/bin/$binary" ]] || missing+=("$binary")
    done
    if (( ${#missing[@]} )) && ! add_missing "${missing[@]}"; then
        echo "Could not build ${missing[*]} beside the existing build." >&2
    else
        echo "Smoke-running the llama.cpp binaries already in $prefix/bin..."
        smoke "$prefix/bin"
        if [[ "$smoke_status" == 0 ]]; then
            if [[ ! -f "$prefix/BUILD_FLAGS" ]]; then
                # Built before the flags were recorded: this script built GGML_NATIVE=ON only.
                {
                    echo "flags: -DGGML_NATIVE=ON"
                    echo "why: the default, built before this script recorded its flags;" \
                         "it passed the smoke run"
                    echo "cpu: $(build_py cpu)"
                    echo "smoke: $smoke_report"
                } > "$prefix/BUILD_FLAGS"
            elif (( ${#missing[@]} )); then
                # The recorded smoke run now names what was added.
                { grep -v '^smoke:' "$prefix/BUILD_FLAGS"; echo "smoke: $smoke_report"; } \
                    > "$prefix/BUILD_FLAGS.new"
                mv "$prefix/BUILD_FLAGS.new" "$prefix/BUILD_FLAGS"
            fi
            echo "${binaries[*]} already built in $prefix/bin" \
                 "($(tr '\n' ' ' < "$prefix/VERSION")); $(build_py summary "$prefix/BUILD_FLAGS")"
            exit 0
        fi
        echo "The existing build fails its smoke run: $smoke_report" >&2
    fi
    echo "Removing it and building again." >&2
    for binary in "${binaries[@]}"; do
        rm -f "$prefix/bin/$binary"
    done
    rm -f "$prefix/VERSION" "$prefix/BUILD_FLAGS"
fi
rm -f "$prefix/BUILD_FLAGS"  # written again only once a build passed its smoke run

mkdir -p "$prefix/src" "$prefix/bin"
started=$(date +%s)

if [[ -n "${LLAMA_CPP_SOURCE:-}" ]]; then
    source_dir="$(cd "$LLAMA_CPP_SOURCE" && pwd)"
    source_name="llama.cpp source in $source_dir"
    echo "[1/4] Using the llama.cpp tree in $source_dir (LLAMA_CPP_SOURCE)"
    echo "[2/4] (nothing to unpack)"
else
    echo "[1/4] Downloading the llama-cpp-python sdist (for its vendored llama.cpp)..."
    sdist_dir="$prefix/src/sdist"
    rm -rf "$sdist_dir" && mkdir -p "$sdist_dir"
    "$python" -m pip download --quiet --no-binary :all: --no-deps llama-cpp-python -d "$sdist_dir"
    sdist="$(ls "$sdist_dir"/llama_cpp_python-*.tar.gz | head -1)"
    source_name="$(basename "$sdist" .tar.gz)"
    echo "      $source_name"

    echo "[2/4] Unpacking..."
    tar -xzf "$sdist" -C "$sdist_dir"
    source_dir="$sdist_dir/$source_name/vendor/llama.cpp"
fi
if [[ ! -f "$source_dir/CMakeLists.txt" ]]; then
    echo "no llama.cpp CMakeLists.txt in $source_dir" >&2
    exit 1
fi

# build FLAGS...: configures a fresh build tree with these CPU flags and builds the binaries.
build() {
    echo "[3/4] Configuring with CMake (Release, $*, server on, curl off)..."
    rm -rf "$build_dir"
    cmake -S "$source_dir" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF "$@" \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        > "$prefix/src/cmake-configure.log"
    echo "[4/4] Building ${binaries[*]} with $jobs jobs (about 12 minutes on 2 cores)..."
    # Static libraries so the binaries can be copied into bin/ with nothing else beside them.
    build_targets "${binaries[@]}" || exit 1
}

native_flags=(-DGGML_NATIVE=ON)
plan="$(build_py plan)"
if [[ "${LLAMA_CPP_EXPLICIT:-0}" == 1 ]]; then
    # A build for a narrower CPU than this one (with LLAMA_CPP_CPUINFO listing its flags): e.g.
    # the AVX2 baseline of an AVX2 machine, built and timed on an AVX-512 one.
    plan="explicit: LLAMA_CPP_EXPLICIT=1, the flags LLAMA_CPP_CPUINFO lists"
fi
if [[ "$plan" == native ]]; then
    flags=("${native_flags[@]}")
    why="the default, every extension this CPU has; it passed the smoke run"
else
    read -r -a flags <<< "$(build_py explicit-flags)"
    why="chosen up front, ${plan#explicit: }; it passed the smoke run"
    echo "Not building GGML_NATIVE=ON: ${plan#explicit: }"
fi
build "${flags[@]}"
echo "Smoke-running the new ${binaries[*]}..."
smoke "$build_dir/bin"
if [[ "$smoke_status" == 3 && "${flags[0]}" == -DGGML_NATIVE=ON ]]; then
    echo "The GGML_NATIVE=ON build fails its smoke run: $smoke_report" >&2
    read -r -a flags <<< "$(build_py explicit-flags)"
    echo "Building again with GGML_NATIVE=OFF and explicit flags, AMX off: ${flags[*]}" >&2
    why="the GGML_NATIVE=ON build died at its smoke run: ${smoke_report%%$'\n'*}"
    build "${flags[@]}"
    echo "Smoke-running the new ${binaries[*]}..."
    smoke "$build_dir/bin"
fi
if [[ "$smoke_status" != 0 ]]; then
    echo "The build (${flags[*]}) fails its smoke run: $smoke_report" >&2
    echo "Nothing installed in $prefix/bin." >&2
    exit 1
fi
for binary in "${binaries[@]}"; do
    cp "$build_dir/bin/$binary" "$prefix/bin/$binary"
done

# The version the bench reports: the sdist's name pins the llama-cpp-python release, the vendored
# tree's git metadata (shipped in the sdist) the llama.cpp commit, and llama-server --version what
# the binary says of itself.
{
    echo "$source_name"
    echo "llama.cpp commit $(git -C "$source_dir" rev-parse HEAD 2>/dev/null || echo unknown)"
    "$prefix/bin/llama-server" --version 2>&1 | grep -E "^version:" || true
} > "$prefix/VERSION"
# The flags, last: their presence says this build passed its smoke run here.
{
    echo "flags: ${flags[*]}"
    echo "why: $why"
    echo "cpu: $(build_py cpu)"
    # What ggml's CMake made of the flags: the compiler options of its CPU backend.
    sed -n 's/.*Adding CPU backend variant ggml-cpu: *//p' "$prefix/src/cmake-configure.log" \
        | head -1 | sed 's/^/compiler: /'
    echo "smoke: $smoke_report"
} > "$prefix/BUILD_FLAGS"
elapsed=$(( $(date +%s) - started ))
echo "Built ${binaries[*]} in $prefix/bin in ${elapsed}s" \
     "($(tr '\n' ' ' < "$prefix/VERSION")); $(build_py summary "$prefix/BUILD_FLAGS")"
