"""The persistent prompt cache (--cache-persist): a store that reopens, checks every record when it
is used and never serves a bad one; `rewind cache stats|clear|verify`; real servers on loopback
restarted on the same folder, killed with -9, given corrupted bytes, a full device, a foreign
file, a second server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import Live, greedy_completion, post, tiny_live_server
from test_disk_faults import tmpfs
from test_store import record_of, same

from rewind.cache import persist
from rewind.cache.store import ScratchStore

# Three conversations over a shared 512-token prefix; each prompt ends off a block boundary.
BASE = [(11 * i) % 500 + 3 for i in range(520)]
PROMPTS = [BASE + [(i * 5 + k) % 500 + 3 for k in range(90)] for i in range(3)]


def keyed(i: int) -> bytes:
    return bytes([i]) * 16


# ---- the store -------------------------------------------------------------------------------

def fill(store: ScratchStore, count: int, start: int = 0) -> dict[bytes, object]:
    records, parent = {}, None
    for i in range(start, start + count):
        record = record_of(1000, i)
        assert store.put(keyed(i), parent, record)
        records[keyed(i)] = record
        parent = keyed(i)
    assert store.flush(30)
    return records


def test_a_reopened_store_serves_its_records(tmp_path):
    store = ScratchStore(tmp_path, 1 << 20, persist=True)
    assert store.persistent
    records = fill(store, 8)
    store.close()
    assert sorted(os.listdir(tmp_path)) == [persist.DATA_NAME, persist.INDEX_NAME,
                                            persist.LOCK_NAME]
    again = ScratchStore(tmp_path, 1 << 20, persist=True)
    try:
        stats = again.stats()
        assert stats["loaded_records"] == 8 and stats["loaded_bytes"] == stats["bytes"] > 0
        assert all(same(again.get(key), record) for key, record in records.items())
        assert again.stats()["corrupt"] == 0
    finally:
        again.close()


def crash_copy(source: Path, target: Path) -> Path:
    """The folder as a kill -9 would leave it (the owner is still running)."""
    target.mkdir()
    for name in (persist.DATA_NAME, persist.INDEX_NAME):
        shutil.copyfile(source / name, target / name)
    return target


def test_bytes_overwritten_after_the_snapshot_are_a_miss_never_a_wrong_record(tmp_path):
    store = ScratchStore(tmp_path / "live", 1 << 20, persist=True, snapshot_records=10_000,
                         snapshot_seconds=1e9)
    try:
        records = fill(store, 4)  # four chains of one record each below
        for i in range(4, 8):
            assert store.put(keyed(i), None, record_of(1000, i))
            records[keyed(i)] = record_of(1000, i)
        store.flush(30)
        assert store.snapshot()
        old = store._debug_slots()[keyed(7)]
        store.discard(keyed(7))  # its range is free now...
        assert store.put(keyed(9), None, record_of(1000, 9))  # ...and reused, same size
        store.flush(30)
        assert store._debug_slots()[keyed(9)].offset == old.offset
        crashed = crash_copy(tmp_path / "live", tmp_path / "crashed")
    finally:
        store.close()
    reopened = ScratchStore(crashed, 1 << 20, persist=True)
    try:
        assert reopened.stats()["loaded_records"] == 8  # the snapshot's view
        assert reopened.get(keyed(7)) is None  # its bytes are keyed(9)'s now: a miss
        assert reopened.get(keyed(9)) is None  # written after the snapshot: lost
        for i in range(7):
            assert same(reopened.get(keyed(i)), records[keyed(i)])
        stats = reopened.stats()
        assert stats["corrupt"] == 1 and stats["entries"] == 7
        reopened.put(keyed(10), None, record_of(1000, 10))  # the freed range serves again
        reopened.flush(30)
        assert same(reopened.get(keyed(10)), record_of(1000, 10))
    finally:
        reopened.close()


def test_an_idle_store_writes_its_index_without_waiting_for_more_records(tmp_path):
    """Records written and then nothing more: the index is written once the writer has been
    idle `snapshot_seconds`, not only at the next write or at close, so a process killed while
    idle (kill -9, a crash) loses none of them. Reading the folder while the store is still
    open is what a restart after a kill reads."""
    store = ScratchStore(tmp_path, 1 << 20, persist=True, snapshot_records=10_000,
                         snapshot_seconds=0.2)
    try:
        fill(store, 3)
        deadline = time.monotonic() + 30
        while store.stats()["snapshots"] == 0:
            assert time.monotonic() < deadline, "no index written while idle"
            time.sleep(0.02)
        index = persist.read_index(tmp_path)
        assert index is not None and {entry.key for entry in index.entries} == {
            keyed(i) for i in range(3)}
        time.sleep(0.5)  # nothing new: no more snapshots
        assert store.stats()["snapshots"] == 1
    finally:
        store.close()


def test_no_unindexed_changes_means_the_index_on_disk_lists_every_record(tmp_path):
    """What a supervisor (or the kill -9 test) reads before it kills: 0 unindexed changes must
    mean the index file lists every record written so far. A snapshot counted its changes as
    indexed before its file was written, so a reader in that window saw 0 and a kill then lost
    the records (a restart found an index without them and emptied the data file)."""
    store = ScratchStore(tmp_path, 64 << 20, persist=True, snapshot_records=1,
                         snapshot_seconds=1e9)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            stats = store.stats()
            if stats["unindexed_changes"] or stats["queued"]:
                continue
            index = persist.read_index(tmp_path)
            listed = 0 if index is None else len(index.entries)
            if listed < stats["records_written"]:
                seen.append((listed, stats["records_written"]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(120):
            assert store.put(keyed(i), None, record_of(64, i))
            assert store.flush(30)
    finally:
        stop.set()
        watcher.join()
        store.close()
    assert seen == []


def test_a_foreign_or_old_index_is_set_aside(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rewind.cache.store")
    store = ScratchStore(tmp_path, 1 << 20, persist=True)
    fill(store, 2)
    store.close()
    data = (tmp_path / persist.INDEX_NAME).read_bytes()
    (tmp_path / persist.INDEX_NAME).write_bytes(data[:8] + (99).to_bytes(4, "little") + data[12:])
    again = ScratchStore(tmp_path, 1 << 20, persist=True)
    try:
        assert again.persistent and again.stats()["loaded_records"] == 0
        assert again.stats()["set_aside"] == 1 and again.get(keyed(0)) is None
        fill(again, 1, start=5)
    finally:
        again.close()
    aside = [p.name for p in tmp_path.iterdir() if persist.SET_ASIDE_SUFFIX in p.name]
    assert len(aside) == 2, aside
    warnings = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(warnings) == 1 and "version 99" in warnings[0]


def test_a_second_store_on_the_folder_uses_a_private_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rewind.cache.store")
    first = ScratchStore(tmp_path, 1 << 20, persist=True)
    second = ScratchStore(tmp_path, 1 << 20, persist=True)
    try:
        assert first.persistent and second.enabled and not second.persistent
        fill(second, 2)
        assert any("owned by another Rewind process" in r.getMessage() for r in caplog.records)
    finally:
        second.close()
        first.close()


def cache_command(folder: Path, action: str, capsys) -> tuple[int, dict]:
    from rewind.commands.cache import run

    code = run(argparse.Namespace(action=action, cache_dir=folder, json=True))
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def test_the_cache_command(tmp_path, capsys):
    store = ScratchStore(tmp_path, 1 << 20, persist=True)
    store.note_model("model-fingerprint")
    fill(store, 5)
    assert cache_command(tmp_path, "verify", capsys)[0] == 1  # in use: refused
    assert store.snapshot()  # stats reads the last snapshot
    code, stats = cache_command(tmp_path, "stats", capsys)  # stats is fine while in use
    assert code == 0 and stats["in_use"] and stats["records"] == 5
    store._debug_corrupt(keyed(2), 50)
    store.close()
    code, stats = cache_command(tmp_path, "stats", capsys)
    assert code == 0 and stats["models"] == ["model-fingerprint"] and stats["records"] == 5
    code, verified = cache_command(tmp_path, "verify", capsys)
    assert code == 1 and verified["bad_records"] == 1 and verified["good_records"] == 4
    code, cleared = cache_command(tmp_path, "clear", capsys)
    assert code == 0 and persist.DATA_NAME in cleared["removed"]
    assert cache_command(tmp_path, "stats", capsys)[1]["records"] == 0


# ---- live servers ----------------------------------------------------------------------------

def answers(live: Live, prompts=PROMPTS) -> tuple[list[list[str]], list[int]]:
    texts, cached = [], []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
        answer = post(live, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        texts.append(data["choices"][0]["logprobs"]["tokens"])
        cached.append(data["usage"]["prompt_tokens_details"]["cached_tokens"])
    return texts, cached


@pytest.fixture(scope="module")
def expected(tiny_model_path, tmp_path_factory) -> list[list[str]]:
    with tiny_live_server(tiny_model_path("llama"), tmp_path_factory.mktemp("nocache"),
                          cache={"enabled": False}) as live:
        texts, cached = answers(live)
    assert cached == [0, 0, 0]
    return texts


def persistent(tiny_model_path, folder: Path, **cache):
    return tiny_live_server(tiny_model_path("llama"), folder,
                            cache={"persist": True, "ram_bytes": 0, **cache})


def store_of(live: Live) -> ScratchStore:
    return live.engine.prompt_cache.store


def test_a_restarted_server_resumes_conversations_from_disk(tiny_model_path, tmp_path,
                                                            expected):
    with persistent(tiny_model_path, tmp_path) as live:
        assert store_of(live).persistent
        texts, cached = answers(live)
        assert texts == expected and cached[0] == 0
    with persistent(tiny_model_path, tmp_path) as live:
        stats = store_of(live).stats()
        assert stats["loaded_records"] > 0 and stats["loaded_bytes"] > 0
        scraped = httpx.get(f"{live.url}/metrics").text
        assert f"rewind_prompt_cache_loaded_records {float(stats['loaded_records'])}" in scraped
        texts, cached = answers(live)
        assert texts == expected
        # The whole prompt but its last token, partial point included: from the disk.
        assert cached == [len(p) - 1 for p in PROMPTS]
        assert live.engine.prompt_cache.stats()["tokens_restored_disk"] >= sum(cached)


def test_corrupted_bytes_in_the_data_file_cost_that_record_only(tiny_model_path, tmp_path,
                                                                 expected):
    with persistent(tiny_model_path, tmp_path) as live:
        assert answers(live)[0] == expected
        # The partial point of the second conversation (its own spine record): a leaf.
        key = live.engine.prompt_cache.point_keys(PROMPTS[1][:-1])["kv"]
    index = persist.read_index(tmp_path)
    entry = next(e for e in index.entries if e.key == key)
    with open(tmp_path / persist.DATA_NAME, "r+b") as data:
        data.seek(entry.offset + entry.length // 2)
        data.write(b"\xff" * 16)
    with persistent(tiny_model_path, tmp_path) as live:
        texts, cached = answers(live)
        assert texts == expected
        assert cached[0] == cached[2] == len(PROMPTS[0]) - 1  # the rest hit
        assert cached[1] == 512  # its own point is a miss: back to the shared blocks
        assert store_of(live).stats()["corrupt"] == 1


def test_a_full_device_on_reopen(tiny_model_path, tmp_path, expected):
    with tmpfs(tmp_path / "small", "8m") as small:  # room for the records (4.4 MiB)
        with persistent(tiny_model_path, small) as live:
            assert answers(live)[0] == expected
        filler = small / "filler"
        with open(filler, "wb") as out:  # nothing left: the index cannot even be rewritten
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError:
                pass
        with persistent(tiny_model_path, small) as live:
            store = store_of(live)
            assert store.persistent and store.stats()["loaded_records"] > 0
            texts, cached = answers(live)
            assert texts == expected and cached[0] > 0  # what the device held still serves
            assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
            assert not store.snapshot() and store.stats()["snapshot_errors"] >= 1
        filler.unlink()


def test_a_foreign_file_is_set_aside_by_the_server(tiny_model_path, tmp_path, expected):
    (tmp_path / persist.INDEX_NAME).write_bytes(b"something else entirely" * 10)
    (tmp_path / persist.DATA_NAME).write_bytes(os.urandom(100_000))
    with persistent(tiny_model_path, tmp_path) as live:
        assert store_of(live).stats()["set_aside"] == 1
        texts, cached = answers(live)
        assert texts == expected and cached == [0, 512, 512]
    assert len([p for p in tmp_path.iterdir() if persist.SET_ASIDE_SUFFIX in p.name]) == 2


def test_two_servers_on_one_folder(tiny_model_path, tmp_path, expected, caplog):
    caplog.set_level(logging.WARNING, logger="rewind.cache.store")
    with persistent(tiny_model_path, tmp_path) as first:
        with persistent(tiny_model_path, tmp_path) as second:
            assert store_of(first).persistent and not store_of(second).persistent
            assert store_of(second).enabled
            assert answers(second)[0] == expected
        assert answers(first)[0] == expected
    assert any("owned by another Rewind process" in r.getMessage() for r in caplog.records)


# On demand (pytest --on-demand; 27 s) since CI neared its 20 minutes: tests/test_kill.py's
# kill -9 while streaming and writing, and its SIGKILL restart, cover the same store in small.
@pytest.mark.on_demand
def test_kill_9_during_a_burst_of_writes_then_restart(tiny_model_path, tmp_path):
    from rewind.bench.harness import ServerProcess, free_port

    folder = tiny_model_path("llama")
    # More than the burst can send before the kill, however fast the machine.
    burst = [[(17 * i + k) % 500 + 3 for k in range(600)] for i in range(2000)]

    def greedy(url: str, prompt: list[int]) -> tuple[list[str], int]:
        return greedy_completion(url, prompt, 2)

    def start(log: Path) -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "rewind", "serve", "--model", str(folder), "--port",
                str(port), "--cache-dir", str(tmp_path / "cache"), "--cache-persist",
                "--cache-ram", "0", "--log-level", "warning"]
        server = ServerProcess("rewind", argv, port, log, ready_paths=("/health",)).start()
        server.wait_ready(120)
        return server

    server = start(tmp_path / "first.log")
    done = []

    def writes() -> None:
        try:
            for prompt in burst:
                greedy(server.base_url, prompt)
                done.append(prompt)
        except httpx.TransportError:
            pass

    thread = threading.Thread(target=writes, daemon=True)
    thread.start()
    # Past the first time-based index snapshot (5 s), in the middle of the burst.
    started = time.monotonic()
    while (len(done) < 4 or time.monotonic() - started < 6.5) and time.monotonic() - started < 60:
        time.sleep(0.05)
    os.kill(server.pid, signal.SIGKILL)
    thread.join(30)
    server.stop()
    assert 4 <= len(done) < len(burst)

    replay = burst[:len(done) + 2]  # every prompt sent before the kill, and the ones in flight
    again = start(tmp_path / "second.log")
    try:
        served = [greedy(again.base_url, prompt) for prompt in replay]
    finally:
        again.stop()
    assert sum(cached > 0 for _, cached in served) >= 1  # records from before the kill served
    with tiny_live_server(folder, tmp_path / "nocache", cache={"enabled": False}) as live:
        assert [got for got, _ in served] == [greedy(live.url, p)[0] for p in replay]
