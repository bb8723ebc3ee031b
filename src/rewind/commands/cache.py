"""`rewind cache stats|clear|verify`: see, empty and check the persistent prompt cache
(`rewind serve --cache-persist`) in a cache folder."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cache", help="see, empty or check the persistent prompt cache (--cache-persist)")
    parser.add_argument("action", choices=["stats", "clear", "verify"],
                        help="stats: records, bytes, models; clear: delete the stored cache; "
                        "verify: check every record's checksum")
    parser.add_argument("--cache-dir", default=None, type=Path,
                        help="the cache folder (default: the one `rewind serve` uses)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _holder(folder: Path) -> str:
    from rewind.cache.persist import LOCK_NAME

    try:
        pid = (folder / LOCK_NAME).read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid else "another process"


def run(args: argparse.Namespace) -> int:
    from rewind.cache import persist
    from rewind.paths import scratch_dir

    folder = args.cache_dir or scratch_dir()
    out: dict[str, Any] = {"cache_dir": str(folder)}
    if not folder.is_dir():
        out.update(records=0, bytes=0, note="no such folder")
        return _print(args, out, 0)
    lock = persist.FolderLock(folder)
    try:
        owned = lock.acquire()
    except OSError as error:
        print(f"rewind cache: cannot open the lock in {folder}: {error}", file=sys.stderr)
        return 1
    try:
        out["in_use"] = not owned
        if not owned:
            out["in_use_by"] = _holder(folder)
            if args.action != "stats":
                print(f"rewind cache {args.action}: the cache in {folder} is in use by a running "
                      f"server ({out['in_use_by']}); stop it first", file=sys.stderr)
                return 1
        if args.action == "clear":
            return _print(args, _clear(folder, out), 0)
        try:
            index = persist.read_index(folder)
        except persist.IndexFormatError as error:
            out.update(records=0, bytes=0, error=f"unreadable index: {error} (the next server "
                       "sets it aside)")
            return _print(args, out, 1)
        entries = index.entries if index is not None else []
        data = folder / persist.DATA_NAME
        out.update(records=len(entries), bytes=sum(e.length for e in entries),
                   data_file_bytes=data.stat().st_size if data.exists() else 0)
        if index is not None:
            out["models"] = sorted(index.meta.get("models", {}))
            written = index.meta.get("written")
            if isinstance(written, (int, float)):
                out["index_written"] = time.strftime("%Y-%m-%d %H:%M:%S",
                                                     time.localtime(written))
        out["set_aside_files"] = sorted(p.name for p in folder.iterdir()
                                        if persist.SET_ASIDE_SUFFIX in p.name)
        if args.action == "stats":
            return _print(args, out, 0)
        bad = [(entry, why) for entry, why in persist.iter_records(folder, index or
                                                                   persist.Index())
               if why is not None]
        out.update(bad_records=len(bad), good_records=len(entries) - len(bad),
                   problems=[f"record at {e.offset} ({e.length} bytes): {why}"
                             for e, why in bad[:20]])
        return _print(args, out, 1 if bad else 0)
    finally:
        lock.release()


def _clear(folder: Path, out: dict[str, Any]) -> dict[str, Any]:
    from rewind.cache import persist

    removed = []
    for path in sorted(folder.iterdir()):
        name = path.name
        if (name in (persist.DATA_NAME, persist.INDEX_NAME, persist.INDEX_NAME + ".tmp")
                or name.startswith(persist.DATA_NAME + persist.SET_ASIDE_SUFFIX)
                or name.startswith(persist.INDEX_NAME + persist.SET_ASIDE_SUFFIX)):
            removed.append((name, path.stat().st_size))
            path.unlink()
    out.update(removed=[name for name, _ in removed], bytes_freed=sum(s for _, s in removed))
    return out


def _print(args: argparse.Namespace, out: dict[str, Any], code: int) -> int:
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return code
    for key, value in out.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        print(f"{key.replace('_', ' ')}: {value}")
    return code
