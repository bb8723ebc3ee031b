"""The machine a benchmark ran on, recorded in every results file: CPU, cores, memory, BLAS,
MLX backend and versions, and the load average (other processes on a small machine move the
figures, so a result says how busy the machine was)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        return None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def code_version(source: Path | None = None) -> dict[str, Any]:
    """Where the `rewind` under test was imported from, and its git commit: the code moves while
    benchmarks run (they are meant to run from a frozen worktree), so every result says which
    commit it measured, whether its src/ had uncommitted changes, and a digest of the source
    itself (`source_digest`).

    The commit is that of the git repository holding the package only when that repository
    tracks the package: a copy of src/ inside some other repository (a results folder, a
    scratch checkout on a GPU machine) would otherwise record that repository's commit as
    Rewind's. Else `rewind_commit` is None and `rewind_commit_note` says why."""
    import subprocess

    if source is None:
        import rewind

        source = Path(rewind.__file__).resolve().parent
    source = Path(source).resolve()
    info: dict[str, Any] = {"rewind_source": display_path(source), "rewind_commit": None,
                            "rewind_src_dirty": None, "rewind_src_digest": source_digest(source)}

    def git(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(source), *argv], capture_output=True, text=True,
                              timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0:
            info["rewind_commit_note"] = "the package is not inside a git repository"
            return info
        root = Path(top.stdout.strip()).resolve()
        # The package's own __init__.py, tracked in that repository and in its HEAD.
        marker = (source / "__init__.py").relative_to(root).as_posix()
        tracked = git("ls-files", "--error-unmatch", "--", f":(top){marker}")
        committed = git("cat-file", "-e", f"HEAD:{marker}")
        if tracked.returncode != 0 or committed.returncode != 0:
            info["rewind_commit_note"] = (
                f"{marker} is not tracked by the enclosing git repository ({root.name}): a copy "
                "of the package, so that repository's commit is not Rewind's")
            return info
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", ".")
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        info["rewind_commit_note"] = f"git could not be asked ({type(exc).__name__}: {exc})"
        return info
    if commit.returncode == 0:
        info["rewind_commit"] = commit.stdout.strip()
        info["rewind_src_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    return info


def source_digest(source: Path) -> str | None:
    """sha256 (12 hex digits) of the package's source files, their paths and contents: it names
    the code that ran where git cannot (a copy with uncommitted changes, a tree without git).
    The same tree gives the same digest on any machine, so a report from a dirty copy can be
    matched to a commit by running this over that commit's src/rewind."""
    import hashlib

    digest = hashlib.sha256()
    try:
        files = sorted(p for p in source.rglob("*") if p.is_file()
                       and p.suffix in (".py", ".c", ".h", ".cu", ".cuh", ".json")
                       and "__pycache__" not in p.parts)
        for path in files:
            digest.update(path.relative_to(source).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    except OSError:
        return None
    return digest.hexdigest()[:12]


def nvidia_gpu() -> dict[str, str] | None:
    """The first NVIDIA GPU's name and driver version, as nvidia-smi gives them (None without
    one, or when nvidia-smi does not answer)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or "," not in lines[0]:
        return None
    name, driver = (part.strip() for part in lines[0].rsplit(",", 1))
    return {"name": name, "driver": driver}


def machine_info() -> dict[str, Any]:
    """Facts about this machine and process; call it after the measurement (for the load)."""
    from rewind import blas

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "blas": blas.status(),
        "openblas_preloaded": blas.openblas_active(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "gpu": nvidia_gpu(),
        **code_version(),
    }
    try:
        from rewind.mlx_install import inspect

        info["mlx_backend"] = inspect().backend
    except Exception:  # noqa: BLE001 - a report never fails on a fact it cannot read
        info["mlx_backend"] = None
    try:
        from rewind.kernels import native

        info["cpu_kernels"] = native.kernels_summary()
    except Exception:  # noqa: BLE001 - a report never fails on a fact it cannot read
        info["cpu_kernels"] = None
    try:
        import mlx.core as mx

        info["mlx_device"] = str(mx.default_device())
    except ImportError:
        info["mlx_device"] = None
    if hasattr(os, "getloadavg"):
        info["load_average_1_5_15"] = [round(value, 2) for value in os.getloadavg()]
    return info


def machine_markdown(info: dict[str, Any]) -> str:
    """A short Markdown list of the machine facts."""
    return "\n".join(f"- {key}: {value}" for key, value in info.items())


def repo_root() -> Path:
    """The repository of the `rewind` under test (src/rewind -> the folder above src/)."""
    import rewind

    return Path(rewind.__file__).resolve().parents[2]


def display_path(path: str | Path) -> str:
    """A path as a user would type it: relative to the repository when inside it, `~/...` when
    under the home folder, else as it is. Results then read the same on every machine."""
    resolved = Path(path).expanduser().absolute()
    for base, prefix in ((repo_root(), ""), (Path.home(), "~/")):
        try:
            relative = resolved.relative_to(base)
        except ValueError:
            continue
        return prefix + str(relative) if str(relative) != "." else (prefix.rstrip("/") or ".")
    return str(path)


def _quote(word: str) -> str:
    """shlex.quote, except that a leading `~/` stays outside the quotes (so the shell expands it)."""
    import shlex

    return "~/" + shlex.quote(word[2:]) if word.startswith("~/") else shlex.quote(word)


def _display_arg(arg: str) -> str:
    """One argument, quoted for a shell, with any absolute path in it (`/x/y` or `--opt=/x/y`)
    shown by display_path."""
    option, equals, value = arg.partition("=")
    if equals and option.startswith("-") and value.startswith("/"):
        return f"{_quote(option)}={_quote(display_path(value))}"
    return _quote(display_path(arg) if arg.startswith("/") else arg)


def user_command(argv: list[str]) -> str:
    """A child process's argv as a user would type it: `python -m rewind ...` -> `rewind ...`,
    `python -m mlx_lm server` -> `mlx_lm server`, paths by display_path."""
    words = list(argv)
    if len(words) >= 3 and words[1] == "-m" and Path(words[0]).name.startswith("python"):
        words = words[2:]  # the module's console script has the module's name
    return " ".join(_display_arg(word) for word in words)


def command_line() -> str:
    """The command that made a results file, as a person would type it again (paths relative to
    the repository, see display_path)."""
    argv = sys.argv[1:]
    # Through `python -m rewind` or `rewind` the argv starts at the subcommand.
    if argv and argv[0] == "bench":
        return user_command(["rewind", *argv])
    return user_command(sys.argv)
