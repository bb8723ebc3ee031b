"""scripts/install-llama-cpp.sh: which CPU flags it builds llama.cpp with, the smoke run that
proves a build runs here, and the rebuild without AMX when a native build dies (issue 23: on a
Sapphire Rapids Xeon whose kernel does not grant AMX state, the GGML_NATIVE=ON binaries died at
start with SIGSEGV).

Nothing here builds llama.cpp (about 12 minutes). The binaries that die are real processes that
really die of a signal: shell scripts that kill themselves, and, for the script end to end, a
tiny CMake project standing in for llama.cpp's tree whose GGML_NATIVE=ON build dereferences NULL
(SIGSEGV) or runs ud2 (SIGILL) and whose explicit build runs. The script configures and builds it
with the real cmake and compiler, smoke-runs it and records the flags, as it does llama.cpp.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.bench import llama_cpp_build as build
from rewind.bench.servers import LLAMA_CPP_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "install-llama-cpp.sh"
HELPER = REPO_ROOT / "src" / "rewind" / "bench" / "llama_cpp_build.py"

# /proc/cpuinfo's flags of a Xeon Platinum 8480+ (Sapphire Rapids), the CPU of issue 23.
SAPPHIRE_RAPIDS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni "
    "pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand "
    "hypervisor lahf_lm abm 3dnowprefetch fsgsbase bmi1 avx2 smep bmi2 erms invpcid avx512f "
    "avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
    "xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke "
    "waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid "
    "cldemote movdiri movdir64b fsrm md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile "
    "amx_int8 arch_capabilities")
# A Haswell-era server CPU: AVX2, no AVX-512.
HASWELL = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ssse3 fma cx16 sse4_1 "
           "sse4_2 popcnt aes xsave avx f16c rdrand lahf_lm abm bmi1 avx2 bmi2 erms")


def cpuinfo(flags: str, model: str = "Test CPU") -> str:
    return (f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\n"
            f"flags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")


def on_off(argv: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("-D").split("=", 1) for arg in argv)


# --- which flags for this CPU --------------------------------------------------------------------
def test_a_sapphire_rapids_xeon_gets_every_avx512_extension_ggml_has_and_no_amx() -> None:
    options = on_off(build.explicit_flags(build.cpu_flags(cpuinfo(SAPPHIRE_RAPIDS))))
    assert options.pop("GGML_NATIVE") == "OFF"
    assert {name for name, value in options.items() if value == "ON"} == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C",
        "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16"}
    assert options["GGML_AMX_TILE"] == options["GGML_AMX_INT8"] == options["GGML_AMX_BF16"] == "OFF"


def test_an_avx2_cpu_gets_avx2_and_nothing_of_avx512() -> None:
    options = on_off(build.explicit_flags(build.cpu_flags(cpuinfo(HASWELL))))
    assert options["GGML_AVX2"] == options["GGML_FMA"] == options["GGML_F16C"] == "ON"
    assert {name for name, value in options.items()
            if name.startswith(("GGML_AVX512", "GGML_AMX", "GGML_AVX_VNNI"))
            and value == "ON"} == set()


def test_avx512_needs_all_five_extensions_ggml_compiles_it_with() -> None:
    # GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw.
    flags = build.cpu_flags(cpuinfo(HASWELL + " avx512f avx512cd avx512vl avx512dq"))
    assert on_off(build.explicit_flags(flags))["GGML_AVX512"] == "OFF"
    assert on_off(build.explicit_flags(flags | {"avx512bw"}))["GGML_AVX512"] == "ON"


def test_this_cpus_flags_follow_its_cpuinfo() -> None:
    flags = build.cpu_flags(Path("/proc/cpuinfo").read_text())
    options = on_off(build.explicit_flags(flags))
    assert options["GGML_AVX2"] == ("ON" if "avx2" in flags else "OFF")
    assert options["GGML_AVX512"] == ("ON" if "avx512bw" in flags else "OFF")
    assert all(options[name] == "OFF" for name in build.AMX_OPTIONS)


def vendored_ggml_cmake() -> Path | None:
    found = sorted(LLAMA_CPP_PREFIX.glob("src/sdist/*/vendor/llama.cpp/ggml/CMakeLists.txt"))
    return found[-1] if found else None


@pytest.mark.skipif(vendored_ggml_cmake() is None,
                    reason="no vendored llama.cpp tree (bash scripts/install-llama-cpp.sh)")
def test_every_option_the_script_sets_exists_in_the_vendored_ggml() -> None:
    """A renamed option would be ignored by CMake with only a warning; the build would silently
    fall back to ggml's defaults."""
    text = vendored_ggml_cmake().read_text()
    declared = set(re.findall(r"option\((GGML_\w+)", text))
    assert {"GGML_NATIVE", *build.ISA_OPTIONS, *build.AMX_OPTIONS} <= declared


def test_a_cpu_that_lists_amx_the_kernel_refuses_is_built_explicitly_first() -> None:
    flags = build.cpu_flags(cpuinfo(SAPPHIRE_RAPIDS))
    reason = build.plan(flags, granted=False)
    assert reason is not None and "amx_tile" in reason and "ARCH_REQ_XCOMP_PERM" in reason
    assert build.plan(flags, granted=True) is None  # AMX usable: native first, then the smoke run
    assert build.plan(build.cpu_flags(cpuinfo(HASWELL)), granted=False) is None


def test_the_kernel_answers_the_amx_question_here() -> None:
    """The real arch_prctl: a bool on Linux x86-64 (no AMX on the CPU: refused)."""
    granted = build.amx_granted()
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        assert granted is None
        return
    assert isinstance(granted, bool)
    if "amx_tile" not in build.cpu_flags(Path("/proc/cpuinfo").read_text()):
        assert granted is False


def test_the_reports_name_the_flags_and_why() -> None:
    recorded = ("flags: " + " ".join(build.explicit_flags(build.cpu_flags(cpuinfo(HASWELL))))
                + "\nwhy: the GGML_NATIVE=ON build died at its smoke run: `llama-server "
                "--version` died with signal 11 (SIGSEGV)\ncpu: Test CPU\nsmoke: passed: x\n")
    text = build.summary(recorded)
    assert text.startswith("GGML_NATIVE=OFF, SSE42 AVX AVX2 BMI2 FMA F16C on, ")
    assert "AVX512 " in text and "AMX_TILE AMX_INT8 AMX_BF16 off" in text
    assert text.endswith("(the GGML_NATIVE=ON build died at its smoke run: `llama-server "
                         "--version` died with signal 11 (SIGSEGV))")
    assert build.summary("flags: -DGGML_NATIVE=ON\nwhy: the default\n") == (
        "GGML_NATIVE=ON (-march=native) (the default)")


# --- smoke-run or fall back ----------------------------------------------------------------------
def fake_binaries(folder: Path, server: str = "echo 'version: 1 (fake)'",
                  bench: str = "echo 'version: 1 (fake)'",
                  perplexity: str | None = "echo 'version: 1 (fake)'") -> Path:
    """Stand-ins for the three binaries; perplexity=None leaves llama-perplexity out (an install
    from before the script built it)."""
    folder.mkdir(parents=True, exist_ok=True)
    bodies = [("llama-server", server), ("llama-bench", bench)]
    bodies += [] if perplexity is None else [("llama-perplexity", perplexity)]
    for name, body in bodies:
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def run_helper(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_binaries_that_run_pass_the_smoke_run(tmp_path) -> None:
    passed, failure = build.smoke(fake_binaries(tmp_path / "bin"))
    assert failure is None
    assert passed == ["llama-server --version", "llama-bench --version",
                      "llama-perplexity --version", "llama-bench --list-devices"]
    done = run_helper("smoke", str(tmp_path / "bin"))
    assert done.returncode == 0 and done.stdout.startswith("passed: llama-server --version")


@pytest.mark.parametrize("name, number", [("SEGV", signal.SIGSEGV), ("ILL", signal.SIGILL)])
def test_a_binary_that_dies_of_a_signal_is_named_with_it(tmp_path, name, number) -> None:
    folder = fake_binaries(tmp_path / "bin", bench=f"echo starting; kill -{name} $$")
    passed, failure = build.smoke(folder)
    assert passed == ["llama-server --version"]
    assert failure is not None and failure.signal == number
    assert failure.describe() == (f"`llama-bench --version` died with signal {int(number)} "
                                  f"(SIG{name}): starting")
    done = run_helper("smoke", str(folder))
    assert done.returncode == 3, done  # 3: the install script rebuilds without AMX
    assert f"died with signal {int(number)} (SIG{name})" in done.stdout


def test_a_missing_binary_is_a_failure_not_a_signal(tmp_path) -> None:
    folder = fake_binaries(tmp_path / "bin", perplexity=None)
    passed, failure = build.smoke(folder)
    assert passed == ["llama-server --version", "llama-bench --version"]
    assert failure is not None and failure.returncode == 127 and failure.signal is None
    assert failure.describe().startswith("`llama-perplexity --version` exited with code 127")
    assert run_helper("smoke", str(folder)).returncode == 1


def test_a_shell_reporting_128_plus_the_signal_counts_as_dying_of_it(tmp_path) -> None:
    folder = fake_binaries(tmp_path / "bin", server="exit 139")
    _, failure = build.smoke(folder)
    assert failure is not None and failure.signal == signal.SIGSEGV


def test_a_binary_that_fails_without_a_signal_is_a_failure_not_a_reason_to_rebuild(
        tmp_path) -> None:
    folder = fake_binaries(tmp_path / "bin", server="echo 'bad option' >&2; exit 1")
    _, failure = build.smoke(folder)
    assert failure is not None and failure.signal is None
    assert failure.describe() == "`llama-server --version` exited with code 1: bad option"
    assert run_helper("smoke", str(folder)).returncode == 1


# A llama-server stand-in that serves /health and /completion as llama-server does, and dies of
# SIGSEGV at the completion when asked to: the model smoke run's path, without llama.cpp.
FAKE_SERVER = """import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--version" in sys.argv:
    print("version: 1 (fake)")
    sys.exit(0)
DIE = {die!r}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({{"status": "ok"}})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if DIE:
            print("computing the completion", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        self.answer({{"content": " Paris."}})

port = int(sys.argv[sys.argv.index("--port") + 1])
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_server(folder: Path, die: bool) -> Path:
    fake_binaries(folder)
    server = folder / "llama-server"
    server.write_text(f"#!{sys.executable}\n" + FAKE_SERVER.format(die=die))
    return folder


def test_with_a_model_llama_server_must_answer_a_completion(tmp_path) -> None:
    folder = fake_server(tmp_path / "bin", die=False)
    passed, failure = build.smoke(folder, tmp_path / "tiny.gguf")
    assert failure is None, failure.describe()
    assert passed[-2:] == ["llama-bench -m tiny.gguf -p 16 -n 4 -r 1",
                           "llama-server -m tiny.gguf answered /completion"]


def test_a_server_that_dies_computing_the_completion_is_named_with_its_signal(tmp_path) -> None:
    folder = fake_server(tmp_path / "bin", die=True)
    passed, failure = build.smoke(folder, tmp_path / "tiny.gguf")
    assert passed[-1] == "llama-bench -m tiny.gguf -p 16 -n 4 -r 1"
    assert failure is not None and failure.signal == signal.SIGSEGV, failure
    assert failure.command.startswith("llama-server -m tiny.gguf -c 512 -np 1")
    assert failure.describe().endswith("died with signal 11 (SIGSEGV): computing the completion")


# --- the install script end to end, on a stand-in for llama.cpp's tree ---------------------------
FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_llama_cpp C)
option(GGML_NATIVE "" ON)
option(FAKE_DIE_ALWAYS "" OFF)
# As ggml/src/ggml-cpu/CMakeLists.txt says what it compiles its CPU backend with.
message(STATUS "Adding CPU backend variant ggml-cpu: native=${GGML_NATIVE} avx2=${GGML_AVX2} \
amx=${GGML_AMX_TILE}")
foreach(binary llama-server llama-bench llama-perplexity)
    add_executable(${binary} fake.c)
    set_target_properties(${binary} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
    if(GGML_NATIVE OR FAKE_DIE_ALWAYS)
        target_compile_definitions(${binary} PRIVATE DIE)
    endif()
endforeach()
"""
FAKE_SOURCE = """#include <stdio.h>
int main(void) {
    puts("system_info: fake");
    fflush(stdout);
#ifdef DIE
    %s;
#endif
    puts("version: 1 (fake)");
    return 0;
}
"""
DEATHS = {"SIGSEGV": "*(volatile int *)0 = 1", "SIGILL": "__builtin_trap()"}


def fake_llama_cpp(folder: Path, death: str = "SIGSEGV", always: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cmake = FAKE_CMAKE.replace('option(FAKE_DIE_ALWAYS "" OFF)',
                               f'option(FAKE_DIE_ALWAYS "" {"ON" if always else "OFF"})')
    # The instruction-set options ggml declares, so CMake's cache types them as ggml's does.
    cmake += "".join(f'option({name} "" OFF)\n'
                     for name in (*build.ISA_OPTIONS, *build.AMX_OPTIONS))
    (folder / "CMakeLists.txt").write_text(cmake)
    (folder / "fake.c").write_text(FAKE_SOURCE % DEATHS[death])
    return folder


def install(tmp_path: Path, source: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "cpuinfo").write_text(cpuinfo(HASWELL, model="Stand-in CPU"))
    env = {**os.environ, "LLAMA_CPP_SOURCE": str(source),
           "LLAMA_CPP_PREFIX": str(tmp_path / "prefix"), "LLAMA_CPP_SMOKE_MODEL": "",
           "LLAMA_CPP_CPUINFO": str(tmp_path / "cpuinfo"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env,
                          timeout=300)


def cmake_cache(tmp_path: Path) -> dict[str, str]:
    text = (tmp_path / "prefix" / "src" / "build" / "CMakeCache.txt").read_text()
    return dict(re.findall(r"^(GGML_\w+):BOOL=(\w+)$", text, re.M))


@pytest.mark.parametrize("death", ["SIGSEGV", "SIGILL"])
def test_a_native_build_that_dies_is_rebuilt_with_explicit_flags_and_they_are_recorded(
        tmp_path, death) -> None:
    done = install(tmp_path, fake_llama_cpp(tmp_path / "llama.cpp", death))
    assert done.returncode == 0, done.stdout + done.stderr
    number = int(getattr(signal, death))
    assert f"The GGML_NATIVE=ON build fails its smoke run: `llama-server --version` died with " \
           f"signal {number} ({death})\n  last output: system_info: fake" in done.stderr
    prefix = tmp_path / "prefix"
    explicit = build.explicit_flags(build.cpu_flags(cpuinfo(HASWELL)))
    recorded = build.parse_build_flags((prefix / "BUILD_FLAGS").read_text())
    assert recorded["flags"] == " ".join(explicit)
    assert recorded["why"] == ("the GGML_NATIVE=ON build died at its smoke run: `llama-server "
                               f"--version` died with signal {number} ({death})")
    assert recorded["cpu"] == "Stand-in CPU"
    assert recorded["compiler"] == "native=OFF avx2=ON amx=OFF"
    assert recorded["smoke"] == ("passed: llama-server --version, llama-bench --version, "
                                 "llama-perplexity --version, llama-bench --list-devices")
    # What CMake really built the installed binaries with, and that they run.
    cache = cmake_cache(tmp_path)
    assert cache["GGML_NATIVE"] == "OFF" and cache["GGML_AVX2"] == "ON"
    assert cache["GGML_AVX512"] == cache["GGML_AMX_TILE"] == cache["GGML_AMX_INT8"] == "OFF"
    for name in ("llama-server", "llama-bench", "llama-perplexity"):
        assert subprocess.run([prefix / "bin" / name, "--version"]).returncode == 0
    assert "version: 1 (fake)" in (prefix / "VERSION").read_text()
    assert "GGML_NATIVE=OFF, SSE42 AVX AVX2 BMI2 FMA F16C on" in done.stdout.splitlines()[-1]


def test_an_existing_build_is_kept_if_it_runs_and_rebuilt_if_it_dies(tmp_path) -> None:
    source = fake_llama_cpp(tmp_path / "llama.cpp")
    assert install(tmp_path, source).returncode == 0
    prefix = tmp_path / "prefix"
    bench = prefix / "bin" / "llama-bench"
    built = bench.stat().st_mtime_ns

    again = install(tmp_path, source)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already built" in again.stdout and "[3/4]" not in again.stdout
    assert bench.stat().st_mtime_ns == built

    # The same prefix, now holding a llama-bench that dies at start (as the native build did on
    # the Xeon): not reported ready, but removed and built again.
    fake_binaries(prefix / "bin", bench="kill -SEGV $$")
    rebuilt = install(tmp_path, source)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert ("The existing build fails its smoke run: `llama-bench --version` died with signal 11 "
            "(SIGSEGV)") in rebuilt.stderr
    assert "[3/4]" in rebuilt.stdout and "already built" not in rebuilt.stdout
    assert subprocess.run([bench, "--version"], capture_output=True).returncode == 0
    assert (prefix / "BUILD_FLAGS").is_file()


def test_an_install_without_llama_perplexity_gets_it_built_in_its_build_tree(tmp_path) -> None:
    """Installs from before the script built llama-perplexity: it is built in the tree that built
    the others (cmake --build --target, the same flags), smoke-run and recorded; the others stay
    as they were."""
    source = fake_llama_cpp(tmp_path / "llama.cpp")
    assert install(tmp_path, source).returncode == 0
    prefix, build_bin = tmp_path / "prefix", tmp_path / "prefix" / "src" / "build" / "bin"
    server = prefix / "bin" / "llama-server"
    built = server.stat().st_mtime_ns
    for folder in (prefix / "bin", build_bin):
        (folder / "llama-perplexity").unlink()
    flags = build.parse_build_flags((prefix / "BUILD_FLAGS").read_text())["flags"]

    again = install(tmp_path, source)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Building llama-perplexity in the existing build tree" in again.stdout
    assert "already built" in again.stdout and "[3/4]" not in again.stdout
    assert subprocess.run([prefix / "bin" / "llama-perplexity", "--version"]).returncode == 0
    assert server.stat().st_mtime_ns == built
    recorded = build.parse_build_flags((prefix / "BUILD_FLAGS").read_text())
    assert recorded["flags"] == flags
    assert "llama-perplexity --version" in recorded["smoke"]


def test_an_install_whose_build_tree_was_configured_elsewhere_is_rebuilt(tmp_path) -> None:
    """A build tree copied from another folder builds there, not here: the missing binary is not
    taken from it, everything is built again."""
    source = fake_llama_cpp(tmp_path / "llama.cpp")
    assert install(tmp_path, source).returncode == 0
    prefix = tmp_path / "prefix"
    moved = tmp_path / "moved"
    shutil.copytree(prefix, moved / "prefix", symlinks=True)
    shutil.rmtree(prefix)
    (moved / "prefix" / "bin" / "llama-perplexity").unlink()
    done = install(moved, source)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "was configured in" in done.stderr and "[3/4]" in done.stdout
    assert subprocess.run([moved / "prefix" / "bin" / "llama-perplexity",
                           "--version"]).returncode == 0


def test_a_build_that_dies_either_way_installs_nothing(tmp_path) -> None:
    done = install(tmp_path, fake_llama_cpp(tmp_path / "llama.cpp", always=True))
    assert done.returncode == 1
    assert "fails its smoke run" in done.stderr and "Nothing installed" in done.stderr
    prefix = tmp_path / "prefix"
    assert not (prefix / "BUILD_FLAGS").exists()
    assert not (prefix / "bin" / "llama-server").exists()


def test_a_build_from_before_the_flags_were_recorded_is_recorded_as_native(tmp_path) -> None:
    """Builds made before this script smoke-ran them were GGML_NATIVE=ON; one that passes the
    smoke run now is kept, and its flags written."""
    prefix = tmp_path / "prefix"
    fake_binaries(prefix / "bin")
    (prefix / "VERSION").write_text("llama_cpp_python-0.3.36\n")
    done = install(tmp_path, fake_llama_cpp(tmp_path / "llama.cpp"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "already built" in done.stdout
    recorded = build.parse_build_flags((prefix / "BUILD_FLAGS").read_text())
    assert recorded["flags"] == "-DGGML_NATIVE=ON"
