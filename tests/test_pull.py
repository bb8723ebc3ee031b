"""`rewind pull` and models in the Hugging Face cache, against the cache layout huggingface_hub
writes (no hub is reachable here); `rewind ps` against a live pool server."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest

from rewind.cli import build_parser

REPO = "tiny-org/tiny-llama-4bit"


def cache_repo(hub: Path, repo: str, folder: Path) -> Path:
    """Lay `folder` out as huggingface_hub does: blobs by hash, a snapshot of links, refs/main."""
    root = hub / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(repo.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_path) -> Path:
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("REWIND_HOME", str(tmp_path / "home"))
    cache_repo(hub, REPO, tiny_model_path("llama"))
    return hub


def test_the_hub_cache_layout_is_read_as_huggingface_hub_reads_it(hub):
    from rewind.models.catalog import Catalog
    from rewind.models.hf_cache import cached_models

    # huggingface_hub itself sees the repo we laid out...
    scanned = huggingface_hub.scan_cache_dir(hub)
    assert [repo.repo_id for repo in scanned.repos] == [REPO]
    expected = Path(huggingface_hub.snapshot_download(REPO, cache_dir=str(hub),
                                                      local_files_only=True))
    # ...and Rewind finds the same snapshot, by repo id, with its form from the name.
    assert dict(cached_models()) == {REPO: expected}
    entry = Catalog().lookup(REPO)
    assert (entry.kind, entry.path, entry.base) == ("hf", expected, "tiny-org/tiny-llama")


def test_pull_serves_a_cached_repo_offline_and_says_what_to_do_otherwise(hub, monkeypatch,
                                                                         capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = build_parser().parse_args(["pull", REPO, "--quiet"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"rewind serve --model {REPO}" in out and "context 4096" in out

    args = build_parser().parse_args(["pull", "tiny-org/not-here", "--quiet"])
    assert args.func(args) == 1
    error = capsys.readouterr().err
    assert "not reachable" in error and "HF_HUB_OFFLINE" in error and "--model FOLDER" in error

    args = build_parser().parse_args(["pull", "no-slash"])
    assert args.func(args) == 1
    assert "not a Hugging Face repo id" in capsys.readouterr().err


def test_pull_without_a_network_is_the_same_clear_error(hub, monkeypatch, capsys):
    # Nothing listens on port 9: the connection is refused at once, as with no network.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    args = build_parser().parse_args(["pull", "tiny-org/not-here", "--quiet"])
    assert args.func(args) == 1
    assert "not reachable" in capsys.readouterr().err


def test_rewind_ps_lists_what_is_loaded(hub, tmp_path, capsys):
    from pool_server import pool_server

    with pool_server([REPO], tmp_path / "scratch") as (live, _):
        args = build_parser().parse_args(["ps", "--url", live.url])
        assert args.func(args) == 0
        out = capsys.readouterr().out
    assert REPO in out and "loaded" in out and "MiB" in out
    assert "1 loaded of" in out
    args = build_parser().parse_args(["ps", "--url", live.url])
    assert args.func(args) == 1  # the server is gone: a clear line, no traceback
    assert "no server at" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "scratch", ignore_errors=True)
