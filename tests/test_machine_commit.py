"""rewind.bench.machine.code_version records Rewind's commit only from a repository that tracks
the package: a copy of src/rewind inside another repository records no commit, with the reason."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rewind.bench.machine import code_version

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c",
                           "user.email=t@example.com", *argv],
                          check=True, capture_output=True, text=True).stdout.strip()


def _package(folder: Path) -> Path:
    package = folder / "src" / "rewind"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('__version__ = "0"\n')
    return package


def _repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    (path / "README.md").write_text("another project\n")
    _git(path, "add", "README.md")
    _git(path, "commit", "-q", "-m", "other")
    return path


def test_a_tracked_package_records_its_repository_commit(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "rewind-checkout")
    package = _package(repo)
    _git(repo, "add", "src")
    _git(repo, "commit", "-q", "-m", "rewind")
    info = code_version(package)
    assert info["rewind_commit"] == _git(repo, "rev-parse", "HEAD")
    assert info["rewind_src_dirty"] is False
    assert "rewind_commit_note" not in info


def test_a_copy_inside_another_repository_records_no_commit(tmp_path: Path) -> None:
    outer = _repo(tmp_path / "enclosing")
    package = _package(outer / "copy")  # untracked: a copy of src/ dropped into it
    info = code_version(package)
    assert info["rewind_commit"] is None
    assert "not tracked" in info["rewind_commit_note"]


def test_a_package_added_but_never_committed_records_no_commit(tmp_path: Path) -> None:
    outer = _repo(tmp_path / "enclosing")
    package = _package(outer)
    _git(outer, "add", "src")  # in the index, not in HEAD: HEAD is not this code
    assert code_version(package)["rewind_commit"] is None


def test_outside_any_repository_says_so(tmp_path: Path) -> None:
    package = _package(tmp_path / "plain")
    info = code_version(package)
    if "not tracked" in info.get("rewind_commit_note", ""):  # tmp_path inside a repository
        pytest.skip("the temporary folder is inside a git repository")
    assert info["rewind_commit"] is None
    assert "not inside a git repository" in info["rewind_commit_note"]


def test_the_source_digest_names_the_code_not_the_place(tmp_path: Path) -> None:
    """Two copies of one tree: one digest, wherever they lie and whatever git says; a changed
    byte in a source file: another digest."""
    first = _package(tmp_path / "one")
    second = _package(tmp_path / "two")
    (first / "kernel.c").write_text("int x;\n")
    (second / "kernel.c").write_text("int x;\n")
    (second / "__pycache__").mkdir()
    (second / "__pycache__" / "junk.pyc").write_bytes(b"cache")
    assert code_version(first)["rewind_src_digest"] == code_version(second)["rewind_src_digest"]
    (second / "kernel.c").write_text("int y;\n")
    assert code_version(first)["rewind_src_digest"] != code_version(second)["rewind_src_digest"]
