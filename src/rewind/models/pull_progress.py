"""A pull's progress, file by file, for a caller that shows it elsewhere (the server streams it
to the web page): bytes done and total per file and overall.

huggingface_hub's snapshot_download folds every file into one aggregate bar and never says
which file moved, so `download_files` lists the repo and calls hf_hub_download per file with a
progress class bound to that file's name. The files land in the hub cache exactly where
snapshot_download puts them; hf_cache.pull then runs snapshot_download, which finds them all
cached and writes refs/main as usual.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

# Enough to overlap a few shards' transfers without opening one connection per file of a
# 100-shard repo (snapshot_download's own default is 8).
DOWNLOAD_WORKERS = 4


class PullCancelled(RuntimeError):
    """The one waiting for the pull went away: the download stops at its next chunk (what was
    fetched stays as an .incomplete file, and a later pull resumes it)."""


@dataclass
class FileProgress:
    name: str
    done: int
    total: int | None  # None: the hub did not say


class PullProgress:
    """Thread-safe byte counts of one pull. Download threads report; `on_change` is called
    from them (keep it cheap and thread-safe: the server hands it to its event loop)."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, FileProgress] = {}
        self._on_change = on_change
        self._cancelled = threading.Event()

    def plan(self, sizes: dict[str, int | None], cached: set[str]) -> None:
        with self._lock:
            self._files = {name: FileProgress(name, (size or 0) if name in cached else 0, size)
                           for name, size in sizes.items()}
        self._changed()

    def cancel(self) -> None:
        self._cancelled.set()

    def advance(self, name: str, count: int, total: int | None = None) -> None:
        if self._cancelled.is_set():
            raise PullCancelled("the pull was cancelled")
        with self._lock:
            entry = self._files.setdefault(name, FileProgress(name, 0, total))
            if total is not None and entry.total is None:
                entry.total = total
            entry.done = max(0, entry.done + count)
        self._changed()

    def finish(self, name: str) -> None:
        """A file is in the cache: count it whole (a resumed file's first bytes came earlier)."""
        with self._lock:
            entry = self._files.get(name)
            if entry is not None and entry.total is not None:
                entry.done = entry.total
        self._changed()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            files = [FileProgress(f.name, f.done, f.total) for f in self._files.values()]
        total = sum(f.total or f.done for f in files)
        return {"files": [vars(f) for f in files], "done": sum(f.done for f in files),
                "total": total}

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def bar_class(self, name: str) -> type:
        """A tqdm stand-in for hf_hub_download's `tqdm_class`, counting into file `name`."""
        progress = self

        class FileBar:
            def __init__(self, *_: Any, total: int | None = None, initial: int = 0,
                         **__: Any) -> None:
                progress.advance(name, initial, total)

            def __enter__(self) -> FileBar:
                return self

            def __exit__(self, *_: Any) -> None:
                return None

            def update(self, n: int | float | None = 1) -> None:
                progress.advance(name, int(n or 0))

            def close(self) -> None:
                return None

            def refresh(self) -> None:
                return None

            def set_postfix_str(self, *_: Any, **__: Any) -> None:
                return None

        return FileBar


def download_files(repo_id: str, revision: str | None, patterns: list[str], cache_dir: str,
                   progress: PullProgress) -> None:
    """Fetch the files of `repo_id` matching `patterns` into the hub cache, counting bytes into
    `progress`. Hub errors (no such repo, gated, no connection) propagate as huggingface_hub
    raises them; hf_cache.pull turns them into PullErrors."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.utils import filter_repo_objects

    api = HfApi()
    info = api.repo_info(repo_id, revision=revision, files_metadata=True)
    commit = info.sha
    if commit is None:
        raise RuntimeError(f"the hub named no commit for {repo_id!r}")
    siblings = {sibling.rfilename: sibling.size for sibling in info.siblings or []}
    wanted = list(filter_repo_objects(siblings, allow_patterns=patterns))
    cached = {name for name in wanted if _is_cached(cache_dir, repo_id, commit, name)}
    progress.plan({name: siblings[name] for name in wanted}, cached)

    def fetch(name: str) -> None:
        hf_hub_download(repo_id, name, revision=commit, cache_dir=cache_dir,
                        tqdm_class=progress.bar_class(name))
        progress.finish(name)

    missing = [name for name in wanted if name not in cached]
    with ThreadPoolExecutor(max_workers=DOWNLOAD_WORKERS,
                            thread_name_prefix=f"pull-{repo_id}") as workers:
        # list(): the first failure is raised here, once the other files' downloads end.
        list(workers.map(fetch, missing))


def _is_cached(cache_dir: str, repo_id: str, commit: str, name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=commit)
    return isinstance(found, str)
