"""The one entry point: `rewind serve | generate | chat | convert | models | pull | ps |
cache-prompt | cache | bench`.

Each subcommand lives in rewind.commands.<name> with `register(subparsers)`, which adds its parser
and sets `func`. Command modules import mlx and friends inside their functions so that `rewind
--help` is instant and OpenBLAS can be preloaded before mlx loads.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

from rewind import __version__, env, mlx_install, paths
from rewind.blas import ensure_openblas

COMMAND_MODULES = ("serve", "generate", "chat", "convert", "models", "pull", "ps", "cache_prompt",
                   "cache", "bench")


@functools.cache
def _mlx_install() -> mlx_install.MlxInstall:
    """This process's MLX install, read once (main checks it, --version says it)."""
    return mlx_install.inspect()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rewind", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version",
                        version=f"rewind {__version__}, {_mlx_install().describe()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"rewind.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"rewind.commands.{name}":
                raise
            continue  # a command not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # a bad REWIND_* value stops here, before the re-exec and minutes of model loading
        warnings = env.check_all()
        if not env.blas_reexecuted():  # said once, not again by the re-executed process
            for warning in warnings:
                print(f"rewind: warning: {warning}", file=sys.stderr)
    except env.EnvError as exc:
        print(f"rewind: {exc}", file=sys.stderr)
        sys.exit(2)
    if not env.blas_reexecuted():
        install = _mlx_install()
        if install.problem:
            # No backend at all: nothing could run. Two backends: it runs, maybe not where meant.
            print(f"rewind: {'error' if install.library_owner is None else 'warning'}: "
                  f"{install.problem}", file=sys.stderr)
            if install.library_owner is None:
                sys.exit(2)
    # Before MLX compiles anything: a user's own MLX_PTX_CACHE_DIR wins.
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(paths.mlx_kernel_cache_dir()))
    ensure_openblas(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        sys.exit(2)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
