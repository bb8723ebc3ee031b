"""Disk faults under the prompt cache, on a live server with no RAM tier (every record goes to
the disk and every hit comes from it): injected I/O errors, short writes and changed bytes, a
real full device (a 1 MiB tmpfs), the cache folder removed while serving or unusable at start.
Every answer must equal the answer without the cache, the server must keep serving, the fault
must show in /metrics, be logged once (not per record), and nothing may be left on disk."""

from __future__ import annotations

import errno
import logging
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Live, post, tiny_live_server

from rewind.config import DiskFaults

# Three prompts over a shared 512-token prefix, each sent twice: the repeats restore from disk.
BASE = [(11 * i) % 500 + 3 for i in range(520)]
PROMPTS = [BASE + [(i * 5 + k) % 500 + 3 for k in range(90)] for i in range(3)]


def answers(live: Live) -> tuple[list[list[int]], int]:
    """Greedy answers to each prompt twice, and the prompt tokens the cache restored."""
    texts, restored = [], 0
    for prompt in PROMPTS + PROMPTS:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
        answer = post(live, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        texts.append(data["choices"][0]["logprobs"]["tokens"])
        restored += data["usage"]["prompt_tokens_details"]["cached_tokens"]
    return texts, restored


def metric(live: Live, name: str) -> float:
    for line in httpx.get(f"{live.url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.startswith(name + " ") or name.endswith("}"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


def fault_count(live: Live, kind: str) -> float:
    return metric(live, f'rewind_prompt_cache_disk_faults_total{{kind="{kind}"}}')


@pytest.fixture(scope="module")
def expected(tiny_model_path, tmp_path_factory) -> list[list[int]]:
    with tiny_live_server(tiny_model_path("llama"), tmp_path_factory.mktemp("nocache"),
                          cache={"enabled": False}) as live:
        texts, restored = answers(live)
    assert restored == 0
    return texts


@contextmanager
def faulty_server(tiny_model_path, folder: Path, **cache: Any) -> Iterator[Live]:
    with tiny_live_server(tiny_model_path("llama"), folder,
                          cache={"ram_bytes": 0, **cache}) as live:
        yield live


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "rewind.cache.store" and r.levelno >= logging.WARNING]


def test_a_healthy_disk_serves_every_repeat_from_the_disk(tiny_model_path, tmp_path, expected):
    with faulty_server(tiny_model_path, tmp_path) as live:
        texts, restored = answers(live)
        assert texts == expected
        assert restored >= 3 * 512  # each repeat restored its blocks from the disk
        assert metric(live, 'rewind_cached_prompt_tokens_total{tier="disk"}') >= 3 * 512
        assert metric(live, "rewind_prompt_cache_disk_enabled") == 1


@pytest.mark.parametrize("faults,kind", [
    (DiskFaults(write_errno=errno.EIO), "write_errors"),
    (DiskFaults(write_errno=errno.EIO, every=3), "write_errors"),
    (DiskFaults(write_errno=errno.ENOSPC), "disk_full"),
    (DiskFaults(read_errno=errno.EIO), "read_errors"),
    (DiskFaults(flip_reads=True), "corrupt"),
    (DiskFaults(flip_reads=True, every=2), "corrupt"),
], ids=["write-eio", "write-eio-some", "write-enospc", "read-eio", "flipped-bytes",
        "flipped-some"])
def test_injected_faults_cost_recompute_never_an_answer(tiny_model_path, tmp_path, expected,
                                                         caplog, faults, kind):
    caplog.set_level(logging.WARNING, logger="rewind.cache.store")
    with faulty_server(tiny_model_path, tmp_path, disk_faults=faults) as live:
        texts, _ = answers(live)
        assert texts == expected
        # A full device stops the file where it is (later records evict or wait), so it fails
        # once; the other faults hit record after record.
        assert fault_count(live, kind) >= (1 if kind == "disk_full" else 2)
        assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    warnings = store_warnings(caplog)
    assert len(warnings) == 1 and kind in warnings[0], warnings  # once, not per record
    assert list(tmp_path.iterdir()) == []  # the scratch file had no name


def test_short_writes_are_completed(tiny_model_path, tmp_path, expected):
    with faulty_server(tiny_model_path, tmp_path,
                       disk_faults=DiskFaults(short_write=1000)) as live:
        texts, restored = answers(live)
        assert texts == expected and restored >= 3 * 512
        for kind in ("write_errors", "corrupt"):
            assert fault_count(live, kind) == 0


@contextmanager
def tmpfs(folder: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    folder.mkdir()
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_really_full_device(tiny_model_path, tmp_path, expected, caplog):
    caplog.set_level(logging.WARNING, logger="rewind.cache.store")
    with tmpfs(tmp_path / "small", "256k") as small:
        with faulty_server(tiny_model_path, small) as live:  # a 64 MiB budget on 256 KiB
            texts, _ = answers(live)
            assert texts == expected
            assert fault_count(live, "disk_full") >= 1
        assert list(small.iterdir()) == []
    assert len([w for w in store_warnings(caplog) if "disk_full" in w]) == 1


def test_a_read_only_cache_folder_disables_the_disk_tier(tiny_model_path, tmp_path, expected):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as read_only:
        with faulty_server(tiny_model_path, read_only) as live:
            texts, _ = answers(live)
            assert texts == expected
            assert metric(live, "rewind_prompt_cache_disk_enabled") == 0


def test_a_cache_folder_that_is_a_file(tiny_model_path, tmp_path, expected):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with faulty_server(tiny_model_path, not_a_folder) as live:
        texts, _ = answers(live)
        assert texts == expected
        assert metric(live, "rewind_prompt_cache_disk_enabled") == 0


def test_the_cache_folder_removed_while_serving(tiny_model_path, tmp_path, expected):
    folder = tmp_path / "cache"
    with faulty_server(tiny_model_path, folder) as live:
        shutil.rmtree(folder)
        texts, restored = answers(live)
        assert texts == expected
        assert restored >= 3 * 512  # the open file outlives its folder's name
    assert not folder.exists()
