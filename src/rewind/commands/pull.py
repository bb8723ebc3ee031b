"""`rewind pull ORG/NAME`: download an MLX (or GGUF) model from the Hugging Face Hub into its
cache; `rewind serve --model ORG/NAME` (or any request naming it) then serves it."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("pull", help="download a model from the Hugging Face Hub",
                                   description=__doc__)
    parser.add_argument("repo", metavar="ORG/NAME", help="e.g. mlx-community/Qwen3-0.6B-4bit")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rewind.models.catalog import describe
    from rewind.models.hf_cache import PullError, pull

    try:
        path = pull(args.repo, args.revision, show_progress=not args.quiet)
    except PullError as exc:
        print(f"rewind pull: {exc}", file=sys.stderr)
        return 1
    entry = describe(args.repo, path, "hf")
    context = f", context {entry.context_length}" if entry.context_length else ""
    print(f"{args.repo}: {entry.form}, {entry.size_bytes / 1e6:.0f} MB{context} in {path}")
    print(f"serve it with: rewind serve --model {args.repo}")
    return 0
