"""`rewind models [FOLDER ...]`: the default model, the converted models in the cache, and any
model folders given."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="list the default, converted and local models",
                                   description=__doc__)
    parser.add_argument("folders", nargs="*", type=Path, help="local model folders to list as well")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rewind import paths
    from rewind.models.registry import list_models

    entries = list_models(args.folders)
    width = max(len(entry.name) for entry in entries)
    for entry in entries:
        size = f"{entry.size_bytes / 1e6:7.0f} MB" if entry.ready else "  not yet"
        state = "" if entry.ready else "  (converted on first use)"
        print(f"{entry.name:<{width}}  {entry.kind:<9} {size}  {entry.description}{state}")
        print(f"{'':<{width}}  {entry.path}")
    print(f"\nmodels folder: {paths.models_dir()}")
    return 0
