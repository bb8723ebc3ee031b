"""How scripts/install-llama-cpp.sh builds llama.cpp for this CPU, and how it proves the build runs.

The script configures llama.cpp with GGML_NATIVE=ON (-march=native: every extension this CPU
has), builds llama-server, llama-bench and llama-perplexity, and smoke-runs them here before it
calls them built.
A native build can die at its first instruction the kernel refuses: on a Sapphire Rapids Xeon
whose kernel does not grant AMX register state, -march=native switched AMX on and both binaries
died at start (a general-protection fault, SIGSEGV; issue 23). When a binary dies with a signal
at the smoke run, the script builds again with GGML_NATIVE=OFF and explicit flags for the
extensions /proc/cpuinfo lists, AMX off, and smoke-runs that build too.

Up front, `plan` picks the explicit flags straight away where the CPU lists AMX and the kernel
refuses the permission that ggml asks for before it uses AMX (arch_prctl ARCH_REQ_XCOMP_PERM):
a native build would gain nothing from AMX there and might die. The smoke run after every build
stays the rule; the up-front check only saves a build that is known to be at risk.

Standard library only: the install script runs this file by its path, with whatever Python it
found, before anything of Rewind needs to be importable.

    python llama_cpp_build.py plan                      native | explicit: <why>
    python llama_cpp_build.py explicit-flags            the -D arguments for this CPU, one line
    python llama_cpp_build.py smoke BIN_DIR [--model GGUF]
                                                        0 passed, 3 died with a signal, 1 failed
    python llama_cpp_build.py summary BUILD_FLAGS_FILE  the line the bench reports print

LLAMA_CPP_CPUINFO names a file to read instead of /proc/cpuinfo (tests, and a build for
another machine of a known kind).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# The x86 instruction-set options of ggml/CMakeLists.txt (llama.cpp as vendored by the
# llama-cpp-python 0.3.36 sdist) and the /proc/cpuinfo flags each needs. GGML_AVX512 turns on
# -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw (ggml/src/ggml-cpu/CMakeLists.txt), so
# it needs all five.
ISA_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
# Never on in an explicit build: it exists because AMX is what killed the native one.
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

NATIVE_FLAGS = ("-DGGML_NATIVE=ON",)

# Linux x86-64: arch_prctl's syscall number, and the request ggml's amx.cpp makes before it
# hands any tensor to its AMX kernels (ggml_amx_init).
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

SMOKE_PROMPT_TOKENS = 16
SMOKE_GEN_TOKENS = 4
SMOKE_TIMEOUT_S = 180.0


# --- which flags for this CPU --------------------------------------------------------------------
def read_cpuinfo() -> str:
    path = os.environ.get("LLAMA_CPP_CPUINFO") or "/proc/cpuinfo"
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first processor's `flags` line of /proc/cpuinfo, as a set."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return " ".join(value.split())
    return platform.processor() or platform.machine()


def explicit_flags(flags: set[str]) -> list[str]:
    """GGML_NATIVE=OFF and every x86 option ggml has, on where this CPU has what it needs; AMX
    off whatever the CPU lists."""
    argv = ["-DGGML_NATIVE=OFF"]
    for option, needs in ISA_OPTIONS.items():
        argv.append(f"-D{option}={'ON' if all(flag in flags for flag in needs) else 'OFF'}")
    argv += [f"-D{option}=OFF" for option in AMX_OPTIONS]
    return argv


def amx_granted() -> bool | None:
    """Whether the kernel lets this process use AMX tile data (what ggml asks before using AMX);
    None where the question does not arise (not Linux x86-64)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def plan(flags: set[str], granted: bool | None) -> str | None:
    """None: build native first. Otherwise why the explicit flags are the first build."""
    amx = sorted(flag for flag in flags if flag.startswith("amx"))
    if amx and granted is False:
        return (f"this CPU lists {' '.join(amx)} but the kernel refuses AMX register state "
                "(arch_prctl ARCH_REQ_XCOMP_PERM), so GGML_NATIVE=ON would build AMX code that "
                "cannot run here")
    return None


def summary(build_flags: str) -> str:
    """The build as the reports name it, from BUILD_FLAGS' text: `GGML_NATIVE=ON`, or the
    options an explicit build turned on and off, then why."""
    fields = parse_build_flags(build_flags)
    options = dict(arg[2:].split("=", 1) for arg in fields.get("flags", "").split()
                   if arg.startswith("-D") and "=" in arg)
    if options.get("GGML_NATIVE", "ON") == "ON":
        text = "GGML_NATIVE=ON (-march=native)"
    else:
        on = [name.removeprefix("GGML_") for name, value in options.items()
              if name != "GGML_NATIVE" and value == "ON"]
        off = [name.removeprefix("GGML_") for name, value in options.items()
               if name != "GGML_NATIVE" and value != "ON"]
        text = f"GGML_NATIVE=OFF, {' '.join(on) or 'nothing'} on, {' '.join(off) or 'nothing'} off"
    if fields.get("why"):
        text += f" ({fields['why']})"
    return text


def parse_build_flags(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields[key.strip()] = value.strip()
    return fields


# --- smoke-run the binaries ----------------------------------------------------------------------
@dataclass(frozen=True)
class SmokeFailure:
    command: str
    returncode: int | None  # None: it hung, or answered nothing
    output: str

    @property
    def signal(self) -> int | None:
        """The signal the process died of: a negative return code from Python, or 128 + N from
        a shell that ran it."""
        if self.returncode is None:
            return None
        if self.returncode < 0:
            return -self.returncode
        if self.returncode >= 128:
            return self.returncode - 128
        return None

    def headline(self) -> str:
        """What failed and how, one line without its output (BUILD_FLAGS' reason, the reports)."""
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "unknown signal"
            return f"`{self.command}` died with signal {self.signal} ({name})"
        if self.returncode is None:
            return f"`{self.command}` gave no usable answer within {SMOKE_TIMEOUT_S:.0f} s"
        return f"`{self.command}` exited with code {self.returncode}"

    def last_output(self) -> str:
        return " | ".join(line.strip() for line in self.output.strip().splitlines()[-3:]
                          if line.strip())

    def describe(self) -> str:
        tail = self.last_output()
        return f"{self.headline()}: {tail}" if tail else self.headline()


def _shown(argv: list[str]) -> str:
    return " ".join(Path(arg).name if os.sep in arg else arg for arg in argv)


def _run(argv: list[str], timeout: float) -> SmokeFailure | None:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired as timed_out:
        output = timed_out.stdout or b""
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        return SmokeFailure(_shown(argv), None, text)
    except OSError as error:  # missing, or not executable: as a shell says it (127)
        return SmokeFailure(_shown(argv), 127, str(error))
    if done.returncode != 0:
        return SmokeFailure(_shown(argv), done.returncode, done.stdout + done.stderr)
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_answers(bin_dir: Path, model: Path, timeout: float) -> SmokeFailure | None:
    """llama-server loads the model, says /health is fine and completes a few tokens: the path
    the side-by-side bench takes, CPU feature detection, model loading and matmuls included."""
    port = _free_port()
    argv = [str(bin_dir / "llama-server"), "-m", str(model), "-c", "512", "-np", "1",
            "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT)

        def failed() -> SmokeFailure:
            # A server that fails a request may be dying of a signal: give it a moment to exit,
            # so the failure names the signal (and the script rebuilds) rather than a bad answer.
            try:
                returncode: int | None = process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                returncode = None
            log.seek(0)
            return SmokeFailure(_shown(argv), returncode, log.read())

        try:
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    return failed()
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                        if response.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.2)
            body = json.dumps({"prompt": "The capital of France is",
                               "n_predict": SMOKE_GEN_TOKENS}).encode()
            request = urllib.request.Request(f"{base}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    answer = json.loads(response.read())
            except (urllib.error.URLError, OSError, ValueError):
                return failed()
            if not isinstance(answer.get("content"), str):
                return failed()
            return None
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def smoke(bin_dir: Path, model: Path | None = None,
          timeout: float = SMOKE_TIMEOUT_S) -> tuple[list[str], SmokeFailure | None]:
    """Runs llama-server, llama-bench and llama-perplexity from `bin_dir` as far as they can run
    here: each prints its version and build (the binary loads, its static initialisers run),
    llama-bench lists the devices (ggml's CPU backend starts: feature detection, its tables);
    with a GGUF, llama-bench measures a short prefill and decode and llama-server answers one
    completion (model loading, weight repacking, every matmul kernel the build chose; the
    libraries and kernels llama-perplexity is linked with too). Without a model nothing runs a
    matmul, so the SIMD kernels are not exercised; the reports say which smoke run passed.

    Returns what passed and the first failure (None: all passed)."""
    server, bench = str(bin_dir / "llama-server"), str(bin_dir / "llama-bench")
    perplexity = str(bin_dir / "llama-perplexity")
    commands = [[server, "--version"], [bench, "--version"], [perplexity, "--version"],
                [bench, "--list-devices"]]
    if model is not None:
        commands.append([bench, "-m", str(model), "-p", str(SMOKE_PROMPT_TOKENS),
                         "-n", str(SMOKE_GEN_TOKENS), "-r", "1"])
    passed: list[str] = []
    for argv in commands:
        failure = _run(argv, timeout)
        if failure is not None:
            return passed, failure
        passed.append(_shown(argv))
    if model is not None:
        failure = _server_answers(bin_dir, model, timeout)
        if failure is not None:
            return passed, failure
        passed.append(f"llama-server -m {model.name} answered /completion")
    return passed, None


# --- the command line the install script calls ---------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("plan", help="native, or `explicit: <why>` for this CPU and kernel")
    commands.add_parser("explicit-flags", help="the CMake -D arguments for this CPU, AMX off")
    commands.add_parser("cpu", help="this CPU's model name")
    smoke_parser = commands.add_parser("smoke", help="smoke-run llama.cpp's binaries")
    smoke_parser.add_argument("bin_dir", type=Path)
    smoke_parser.add_argument("--model", type=Path, default=None)
    summary_parser = commands.add_parser("summary", help="a BUILD_FLAGS file as reports name it")
    summary_parser.add_argument("build_flags", type=Path)
    args = parser.parse_args(argv)

    cpuinfo = read_cpuinfo()
    if args.command == "plan":
        reason = plan(cpu_flags(cpuinfo), amx_granted())
        print("native" if reason is None else f"explicit: {reason}")
        return 0
    if args.command == "explicit-flags":
        if platform.machine() not in ("x86_64", "AMD64") and "LLAMA_CPP_CPUINFO" not in os.environ:
            print(f"no explicit flags for {platform.machine()}: only x86-64 has them here",
                  file=sys.stderr)
            return 1
        print(" ".join(explicit_flags(cpu_flags(cpuinfo))))
        return 0
    if args.command == "cpu":
        print(cpu_model(cpuinfo))
        return 0
    if args.command == "summary":
        print(summary(args.build_flags.read_text()))
        return 0
    passed, failure = smoke(args.bin_dir, args.model)
    if failure is None:
        print("passed: " + ", ".join(passed))
        return 0
    # The headline first (the install script records that line), then the output's last lines.
    print(failure.headline())
    if failure.last_output():
        print(f"  last output: {failure.last_output()}")
    return 3 if failure.signal is not None else 1


if __name__ == "__main__":
    sys.exit(main())
