"""The C kernels' thread pool (src/rewind/kernels/c/pool.c) runs every block of a job exactly
once, with that job's own function and arguments, before run_blocks returns.

Issue 23's SIGSEGVs came from here: a worker that read a finished job's claim word, then the
next job's fields, claimed a block before the next job opened and ran it twice, so the next
job's caller returned while a worker still read its stack frame. tests/native/pool_stress.c
pauses each side of the claim protocol where that race shows (the pool as it was failed 1,200
to 2,317 of 20,000 jobs there at 2-4 threads; unpaused, 0-3 in 2,000,000 at 4 threads), and a
ThreadSanitizer build checks the protocol has no data race at all."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rewind.kernels import native

HARNESS = Path(__file__).parent / "native" / "pool_stress.c"
HOOK = Path(__file__).parent / "native" / "pool_hook.c"
POOL = native.NATIVE / "pool.c"

pytestmark = pytest.mark.skipif(native.compile_flags() is None or shutil.which("cc") is None,
                                reason="the C kernels need x86-64 with AVX2 and a C compiler")


def _build(tmp_path: Path, name: str, *flags: str) -> Path:
    binary = tmp_path / name
    result = subprocess.run(["cc", "-O2", "-g", "-pthread", "-mavx2", "-mfma", "-mf16c",
                             f"-I{native.NATIVE}", *flags, "-o", str(binary), str(HARNESS),
                             str(POOL), str(HOOK)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        if "-fsanitize=thread" in flags:
            pytest.skip(f"this compiler cannot build with ThreadSanitizer: {result.stderr[-300:]}")
        raise AssertionError(result.stderr)
    return binary


def _run(binary: Path, jobs: int, threads: int, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(binary), str(jobs), str(threads)], capture_output=True,
                            text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "violations 0" in output, output[-3000:]
    return output


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_every_block_runs_once_with_its_own_job_when_each_side_is_paused(tmp_path: Path,
                                                                          threads: int) -> None:
    binary = _build(tmp_path, "pool_stress_paused", "-DPOOL_TESTING")
    _run(binary, 20_000, threads)


def test_every_block_runs_once_with_its_own_job_at_full_speed(tmp_path: Path) -> None:
    binary = _build(tmp_path, "pool_stress")
    _run(binary, 300_000, 4)


def test_the_pool_has_no_data_race_under_thread_sanitizer(tmp_path: Path) -> None:
    binary = _build(tmp_path, "pool_stress_tsan", "-fsanitize=thread", "-DPOOL_TESTING")
    output = _run(binary, 3_000, 3, env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
                                         "PATH": "/usr/bin:/bin"})
    assert "ThreadSanitizer" not in output, output[-3000:]


_FORWARDS = """
import ctypes, sys, tempfile
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from rewind.kernels import native
from rewind.kernels.native_forward import native_forward
from rewind.models.loader import load_model

library = ctypes.CDLL(sys.argv[1])
native._declare(library)
native._kernels, native._tried = library, True  # the paused build instead of the usual one
loaded = load_model(sys.argv[2])
assert native_forward(loaded.model) is not None
prompt = mx.array([list(range(3, 300))])
first = np.array(loaded.model(prompt, cache=make_prompt_cache(loaded.model)))
for _ in range(int(sys.argv[3])):
    again = np.array(loaded.model(prompt, cache=make_prompt_cache(loaded.model)))
    assert np.array_equal(again, first), "a forward pass gave another answer"
print("forwards held")
"""


@pytest.mark.cpu_only  # the native forward runs on the CPU backend alone
def test_a_model_forward_through_a_paused_pool_neither_crashes_nor_changes(tiny_model_path,
                                                                           tmp_path: Path) -> None:
    """The production path: the whole kernels library built with the pauses, under the native
    forward pass of a tiny Gemma 3, in a process of its own. The pool as it was died with
    SIGSEGV in the first forward pass here (in layer_post, as issue 23's servers died)."""
    flags = native.compile_flags()
    library = tmp_path / "paused_kernels.so"
    result = subprocess.run(["cc", *flags, "-DPOOL_TESTING", f"-I{native.NATIVE}", "-o",
                             str(library), *map(str, native.SOURCES), str(HOOK), "-lm"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    import sys

    run = subprocess.run([sys.executable, "-c", _FORWARDS, str(library),
                          str(tiny_model_path("gemma3")), "20"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "forwards held" in run.stdout, \
        f"exit {run.returncode}: {run.stderr[-3000:]}"
