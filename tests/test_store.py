"""The disk tier: free list, one anonymous scratch file, budget, checksums, faults, threads."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from rewind.cache.free_list import FreeList
from rewind.cache.serialize import Record, layout
from rewind.cache.store import ScratchStore
from rewind.cache.writer import Writer

SRC = str(Path(__file__).resolve().parents[1] / "src")


def record_of(n_words: int, fill: int, dtype: mx.Dtype = mx.uint16) -> Record:
    array = (mx.arange(n_words, dtype=mx.uint32) * 7 + fill).astype(dtype)
    mx.eval(array)
    return Record({"data": array}, {"fill": str(fill)})


def same(a: Record | None, b: Record) -> bool:
    return (
        a is not None
        and a.meta == b.meta
        and all(bool(mx.array_equal(a.arrays[k], v)) for k, v in b.arrays.items())
        and all(a.arrays[k].dtype == v.dtype for k, v in b.arrays.items())
    )


def size_of(record: Record) -> int:
    return layout(record).size


def open_fd_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return targets


@pytest.fixture
def store_factory(tmp_path: Path):
    stores: list[ScratchStore] = []

    def make(budget: int, queue_size: int = 64, **kwargs) -> ScratchStore:
        store = ScratchStore(tmp_path / f"scratch{len(stores)}", budget, queue_size, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


# ---- FreeList ------------------------------------------------------------------------------
def test_free_list_coalesces_adjacent_ranges() -> None:
    free = FreeList()
    offsets = [free.append(100) for _ in range(5)]  # 0,100,...,400; end 500
    free.release(offsets[1], 100)
    free.release(offsets[3], 100)
    assert free.ranges() == [(100, 100), (300, 100)]
    free.release(offsets[2], 100)  # joins both neighbours
    assert free.ranges() == [(100, 300)]
    free.release(offsets[0], 100)  # joins the range after it
    assert free.ranges() == [(0, 400)]
    assert free.end == 500 and free.free_bytes == 400


def test_free_list_reuses_the_best_fitting_hole() -> None:
    free = FreeList()
    a, b, c, d, e = (free.append(n) for n in (300, 10, 120, 10, 100))
    free.release(a, 300)
    free.release(c, 120)
    free.release(e, 100)  # at the end: the file shrinks instead
    assert free.end == e
    assert free.take_hole(110) == c  # 120 fits tighter than 300
    assert free.ranges() == [(a, 300), (c + 110, 10)]
    assert free.take_hole(300) == a
    assert free.take_hole(11) is None


def test_free_list_truncates_when_free_space_reaches_the_end() -> None:
    free = FreeList()
    a, b, c = (free.append(100) for _ in range(3))
    assert not free.release(b, 100)
    assert free.release(c, 100)  # tail freed and merged with b: end falls to b's start
    assert free.end == 100 and free.ranges() == []
    assert free.release(a, 100) and free.end == 0


def test_free_list_rejects_double_free() -> None:
    free = FreeList()
    a, _ = free.append(100), free.append(100)
    free.release(a, 100)
    with pytest.raises(ValueError):
        free.release(a + 50, 10)


# ---- ScratchStore: the basics ---------------------------------------------------------------
def test_put_get_round_trip_through_the_file(store_factory) -> None:
    store = store_factory(1 << 20)
    records = {i: record_of(1000, i, dtype) for i, dtype in
               enumerate([mx.bfloat16, mx.float16, mx.float32, mx.uint32, mx.int32])}
    for key, record in records.items():
        assert store.put(key, key - 1 if key else None, record)
    assert store.flush(timeout=30)
    for key, record in records.items():
        assert same(store.get(key), record)
    stats = store.stats()
    assert stats["records_written"] == 5 and stats["hits"] == 5
    assert stats["bytes_written"] == sum(size_of(r) for r in records.values())
    assert stats["file_bytes"] == store._debug_file_size() == stats["bytes"]
    assert store.get("absent") is None and store.stats()["misses"] == 1
    assert store.drop_page_cache()  # cold reads come back the same
    assert all(same(store.get(key), record) for key, record in records.items())


def test_contains_and_get_while_queued(store_factory) -> None:
    store = store_factory(1 << 20)
    store._writer.pause()
    try:
        record = record_of(64, 3)
        store.put("k", None, record)
        assert store.contains("k")
        assert store.stats()["queued"] == 1 and store._debug_file_size() == 0
        assert store.get("k") is record  # served from memory, nothing on disk yet
    finally:
        store._writer.resume()
    store.flush(timeout=30)
    assert store.stats()["queued"] == 0 and store._debug_file_size() == size_of(record)
    assert same(store.get("k"), record)


def test_freed_range_is_reused_and_tail_is_truncated(store_factory) -> None:
    fills = {"a": 11, "b": 12, "c": 13, "d": 14, "e": 15}  # same digits: same blob sizes
    size = size_of(record_of(500, 11))
    store = store_factory(10 * size)
    for key in "abcd":
        store.put(key, None, record_of(500, fills[key]))
    store.flush(timeout=30)
    offsets = {key: slot.offset for key, slot in store._debug_slots().items()}
    assert sorted(offsets.values()) == [0, size, 2 * size, 3 * size]

    store.discard("b")
    store.put("e", None, record_of(500, fills["e"]))
    store.flush(timeout=30)
    assert store._debug_slots()["e"].offset == offsets["b"]  # the hole, not the end
    assert store._debug_file_size() == 4 * size

    store.discard("d")  # the tail: the file shrinks at once
    assert store._debug_file_size() == 3 * size
    store.discard("c")
    store.discard("e")  # e (in b's old range) joins the free tail: down to a alone
    assert store._debug_file_size() == size
    assert store.stats()["free_bytes"] == 0
    assert same(store.get("a"), record_of(500, fills["a"]))


def test_lru_evicts_leaves_and_keeps_chains_whole(store_factory) -> None:
    size = size_of(record_of(200, 0))
    store = store_factory(4 * size)
    for i in range(3):  # chain c0 <- c1 <- c2
        store.put(f"c{i}", f"c{i-1}" if i else None, record_of(200, i))
    store.put("x", None, record_of(200, 7))
    store.flush(timeout=30)
    for key in ("c0", "c1", "c2"):  # a restore reads the chain head first
        assert store.get(key) is not None
    store.put("y", None, record_of(200, 8))  # x is the least recently used leaf
    store.flush(timeout=30)
    assert not store.contains("x") and store.contains("c0")
    store.touch("y")
    store.put("z", None, record_of(200, 9))  # c2 is now the oldest leaf; c0 is older but inner
    store.flush(timeout=30)
    assert [store.contains(k) for k in ("c0", "c1", "c2", "y", "z")] == [True, True, False, True, True]
    assert store.stats()["evictions"] == 2


def test_budget_never_exceeded_in_a_random_sequence(store_factory) -> None:
    rng = random.Random(7)
    budget = 40_000
    store = store_factory(budget, queue_size=4)
    expected: dict[int, Record] = {}
    keys: list[int] = []
    for step in range(400):
        op = rng.random()
        if op < 0.55:
            record = record_of(rng.randint(10, 3000), step, rng.choice([mx.uint16, mx.float32]))
            parent = rng.choice(keys) if keys and rng.random() < 0.6 else None
            store.put(step, parent, record)
            expected[step] = record
            keys.append(step)
        elif op < 0.85 and keys:
            key = rng.choice(keys)
            got = store.get(key)
            assert got is None or same(got, expected[key])
        elif op < 0.95 and keys:
            store.discard(rng.choice(keys))
        else:
            store.flush(timeout=30)
        stats = store.stats()
        assert stats["bytes"] <= budget
        assert stats["file_bytes"] <= budget
        assert store._debug_file_size() <= budget
    store.flush(timeout=30)
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["corrupt"] == 0 and stats["write_errors"] == 0
    assert stats["file_bytes"] == store._debug_file_size()
    live = store._debug_slots()
    assert stats["file_bytes"] == sum(s.length for s in live.values()) + stats["free_bytes"]
    for key in live:  # every survivor reads back exactly, after all the reuse
        assert same(store.get(key), expected[key])


# ---- faults ---------------------------------------------------------------------------------
def test_corrupt_record_is_dropped_with_its_descendants(store_factory) -> None:
    store = store_factory(1 << 20)
    for i in range(4):
        store.put(i, i - 1 if i else None, record_of(300, i))
    store.put("other", None, record_of(300, 9))
    store.flush(timeout=30)
    store._debug_corrupt(1, at=-5)  # a byte inside the array data
    assert store.get(1) is None
    stats = store.stats()
    assert stats["corrupt"] == 1
    assert [store.contains(i) for i in range(4)] == [True, False, False, False]
    assert same(store.get(0), record_of(300, 0)) and same(store.get("other"), record_of(300, 9))


def test_corrupt_header_is_caught_too(store_factory) -> None:
    store = store_factory(1 << 20)
    store.put("k", None, record_of(300, 1))
    store.flush(timeout=30)
    store._debug_corrupt("k", at=0)  # the header length
    assert store.get("k") is None and store.stats()["corrupt"] == 1 and not store.contains("k")


def test_record_larger_than_the_budget_is_not_stored(store_factory) -> None:
    store = store_factory(1000)
    assert not store.put("big", None, record_of(1000, 1))
    store.flush(timeout=30)
    assert not store.contains("big") and store.get("big") is None
    assert store.stats()["rejected"] == 1 and store._debug_file_size() == 0


@pytest.mark.parametrize("where", ["under-a-file", "read-only-proc"])
def test_folder_that_cannot_hold_a_file_disables_the_store(tmp_path: Path, where: str) -> None:
    if where == "under-a-file":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        folder = blocker / "scratch"
    else:
        folder = Path("/proc/self/fdinfo")  # exists, unwritable even for root
    store = ScratchStore(folder, 1 << 20)
    try:
        assert not store.enabled and "cannot open" in store.disabled_reason
        assert not store.put("k", None, record_of(10, 1))
        assert store.get("k") is None and not store.contains("k")
        assert store.flush(timeout=5)
        assert store.stats()["enabled"] is False
    finally:
        store.close()


# Children import the store without running rewind/cache/__init__.py, which pulls in mlx_lm
# and transformers (seconds on this machine) that the store does not use.
CHILD_PREAMBLE = f"""
import sys, types
_package = types.ModuleType("rewind.cache")
_package.__path__ = [{str(Path(SRC) / "rewind" / "cache")!r}]
sys.modules["rewind.cache"] = _package
"""


def child_command(code: str) -> list[str]:
    return [sys.executable, "-c", CHILD_PREAMBLE + textwrap.dedent(code)]


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        child_command(code), capture_output=True, text=True, timeout=timeout, env=env
    )


def test_full_disk_costs_records_not_a_crash(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel refuse writes past a size, as a full disk would (EFBIG
    # instead of ENOSPC: the same path in the store); it only affects the child process.
    child = run_child(f"""
        import json, resource, signal
        import mlx.core as mx
        from rewind.cache.serialize import Record
        from rewind.cache.store import ScratchStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        def rec(i):
            a = (mx.arange(1000, dtype=mx.uint32) + i).astype(mx.uint16); mx.eval(a)
            return Record({{"data": a}}, {{"i": str(i)}})
        store = ScratchStore({str(tmp_path)!r}, 1 << 20)
        resource.setrlimit(resource.RLIMIT_FSIZE, (5000, resource.RLIM_INFINITY))
        puts = [store.put(i, None, rec(i)) for i in range(6)]
        store.flush()
        present = [i for i in range(6) if store.contains(i)]
        good = all(bool(mx.array_equal(store.get(i).arrays["data"], rec(i).arrays["data"]))
                   for i in present)
        print(json.dumps(dict(stats=store.stats(), present=present, good=good, puts=puts)))
        store.close()
    """)
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout.strip().splitlines()[-1])
    stats = result["stats"]
    assert result["puts"] == [True] * 6  # queued: the caller never sees the disk's trouble
    # Two ~2.1 kB records fit under 5000 bytes; the third hits the limit and is lost; from
    # then on the file stays at what the disk took and newer records evict older ones.
    assert stats["write_errors"] == 1 and stats["disk_full"] == 1
    assert "File too large" in stats["last_error"]
    assert result["present"] == [4, 5] and result["good"]
    assert stats["evictions"] == 3 and stats["file_limit"] == stats["file_bytes"] <= 5000
    assert os.listdir(tmp_path) == []


def test_unencodable_record_is_refused_not_raised(store_factory) -> None:
    store = store_factory(1 << 20)
    bad = Record({"z": mx.array([1 + 2j], dtype=mx.complex64)})  # no safetensors code
    assert not store.put("bad", None, bad)
    assert store.stats()["rejected"] == 1 and not store.contains("bad")


@pytest.mark.parametrize("use_o_tmpfile", [True, False], ids=["O_TMPFILE", "unlink"])
def test_no_file_left_open_or_named_after_close(tmp_path: Path, use_o_tmpfile: bool) -> None:
    store = ScratchStore(tmp_path, 1 << 20, use_o_tmpfile=use_o_tmpfile)
    store.put("k", None, record_of(100, 1))
    store.flush(timeout=30)
    assert os.listdir(tmp_path) == []  # nameless even while open
    assert any(t.startswith(str(tmp_path)) for t in open_fd_targets())
    store.close()
    assert os.listdir(tmp_path) == []
    assert not any(t.startswith(str(tmp_path)) for t in open_fd_targets())
    assert store.get("k") is None and not store.put("k", None, record_of(1, 1))
    store.close()  # idempotent


@pytest.mark.parametrize("use_o_tmpfile", [True, False], ids=["O_TMPFILE", "unlink"])
def test_nothing_remains_after_kill_9(tmp_path: Path, use_o_tmpfile: bool) -> None:
    code = f"""
        import os, sys, time
        import mlx.core as mx
        from rewind.cache.serialize import Record
        from rewind.cache.store import ScratchStore
        store = ScratchStore({str(tmp_path)!r}, 1 << 20, use_o_tmpfile={use_o_tmpfile})
        a = mx.arange(50_000, dtype=mx.uint32); mx.eval(a)
        for i in range(5):
            store.put(i, None, Record({{"a": a + i}}))
        store.flush()
        print(store.stats()["file_bytes"], flush=True)
        time.sleep(60)
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen(child_command(code), stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert int(line) > 5 * 200_000
        fds = os.listdir(f"/proc/{child.pid}/fd")
        held = [os.readlink(f"/proc/{child.pid}/fd/{fd}") for fd in fds]
        assert any(h.startswith(str(tmp_path)) and h.endswith("(deleted)") for h in held)
        assert os.listdir(tmp_path) == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path) == []
    assert not os.path.exists(f"/proc/{child.pid}/fd")


# ---- threads ---------------------------------------------------------------------------------
def test_reads_while_the_writer_writes(store_factory) -> None:
    size = size_of(record_of(2000, 0))
    store = store_factory(30 * size, queue_size=8)  # small enough to evict and reuse ranges
    expected = {i: record_of(2000, i) for i in range(120)}
    done = threading.Event()
    wrong: list[int] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        rng = random.Random(3)
        while not done.is_set() or reads < 200:
            key = rng.randrange(120)
            got = store.get(key)
            reads += 1
            if got is not None and not same(got, expected[key]):
                wrong.append(key)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for key, record in expected.items():
            store.put(key, key - 1 if key % 10 else None, record)  # chains of ten
    finally:
        store.flush(timeout=60)
        done.set()
        thread.join(timeout=60)
    stats = store.stats()
    assert wrong == [] and stats["corrupt"] == 0 and stats["write_errors"] == 0
    assert stats["hits"] > 0 and stats["evictions"] > 0
    assert stats["bytes"] <= 30 * size


def test_queued_bytes_are_bounded(store_factory) -> None:
    first, second = record_of(1000, 1), record_of(1000, 2)
    store = store_factory(1 << 20, queue_bytes=size_of(first) * 3 // 2)
    store._writer.pause()
    try:
        assert store.put("a", None, first)  # an empty queue always takes one record
        waiting = threading.Thread(target=store.put, args=("b", None, second))
        waiting.start()
        waiting.join(timeout=0.2)
        assert waiting.is_alive()  # b would exceed the queued-bytes bound while a waits
        assert store.stats()["queued_bytes"] == size_of(first)
    finally:
        store._writer.resume()
    waiting.join(timeout=30)
    store.flush(timeout=30)
    assert same(store.get("a"), first) and same(store.get("b"), second)
    assert store.stats()["queue_waits"] >= 1 and store.stats()["queued_bytes"] == 0


def test_writer_survives_a_failing_job_and_blocks_only_when_full() -> None:
    gate = threading.Event()
    seen: list[int] = []

    def handle(job: int) -> None:
        gate.wait(timeout=30)
        if job == 1:
            raise RuntimeError("bad job")
        seen.append(job)

    writer: Writer[int] = Writer(handle, queue_size=2)
    try:
        writer.submit(0)
        for _ in range(3000):  # until the thread holds job 0 (bounded: 30 s)
            if writer.pending() == 0:
                break
            threading.Event().wait(0.01)
        for job in (1, 2):  # they fill the queue without blocking
            writer.submit(job)
        assert writer.stats()["blocked_submits"] == 0
        blocked = threading.Thread(target=writer.submit, args=(3,))
        blocked.start()
        blocked.join(timeout=0.2)  # it cannot finish: the queue is full
        assert blocked.is_alive()
        gate.set()
        blocked.join(timeout=30)
        assert writer.flush(timeout=30)
        assert seen == [0, 2, 3] and writer.stats()["errors"] == 1
        assert writer.stats()["blocked_submits"] == 1
    finally:
        gate.set()
        writer.close()
    assert not writer.submit(4)
