"""The chain-aware LRU and the RAM hot tier built on it."""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest

from rewind.cache.lru import ChainLRU
from rewind.cache.ram_tier import RamTier
from rewind.cache.serialize import Record


def record_of(nbytes: int, fill: int = 0) -> Record:
    array = mx.full((nbytes,), fill, dtype=mx.uint8)
    mx.eval(array)
    return Record({"data": array}, {"fill": str(fill)})


# ---- ChainLRU ------------------------------------------------------------------------------
def test_evicts_least_recently_used_leaf_first() -> None:
    evicted: list[str] = []
    lru = ChainLRU(300, on_evict=lambda key, parent, nbytes: evicted.append(key))
    for key in "abc":  # three independent entries
        assert lru.add(key, None, 100)
    lru.touch("a")  # b is now the oldest
    assert lru.add("d", None, 100)
    assert evicted == ["b"]
    assert lru.keys_by_recency() == ["c", "a", "d"]
    assert lru.total_bytes == 300


def test_only_leaves_are_evicted_so_a_chain_loses_its_tail() -> None:
    evicted: list[tuple[str, str | None]] = []
    lru = ChainLRU(400, on_evict=lambda key, parent, nbytes: evicted.append((key, parent)))
    lru.add("a1", None, 100)
    lru.add("a2", "a1", 100)
    lru.add("a3", "a2", 100)
    lru.touch_chain(["a1", "a2", "a3"])  # a restore: whole chain used, head first
    lru.add("b1", None, 100)
    # a1 and a2 are older than b1 but they are inner entries: the oldest leaf is a3.
    lru.touch("b1")
    lru.touch("a1")  # even a head touched last does not protect its tail
    lru.add("c1", None, 100)
    assert evicted == [("a3", "a2")]
    lru.add("c2", "c1", 100)
    assert evicted[-1] == ("a2", "a1")  # the tail again, never a1 while a2 lives
    assert "a1" in lru and lru.is_leaf("a1")


def test_a_chain_longer_than_the_budget_keeps_its_head() -> None:
    lru = ChainLRU(250)
    assert lru.add(1, None, 100)
    assert lru.add(2, 1, 100)
    assert not lru.add(3, 2, 100)  # would need to evict its own ancestors
    assert 3 not in lru and lru.total_bytes == 200
    assert not lru.add("huge", None, 251)
    assert lru.total_bytes == 200


def test_refused_entry_evicts_nothing_but_a_fitting_one_clears_other_chains() -> None:
    lru = ChainLRU(300)
    lru.add("x", None, 100)
    lru.add("a1", None, 100)
    lru.add("a2", "a1", 100)
    assert not lru.add("a3", "a2", 101)  # 301 in its chain: refused, x survives
    assert "x" in lru
    assert lru.add("a3", "a2", 100)  # fits once x is gone
    assert "x" not in lru and len(lru) == 3


def test_parent_arriving_after_its_child_is_not_a_leaf() -> None:
    # The RAM tier spills leaves first, so the disk tier sees children before parents.
    lru = ChainLRU(200)
    lru.add("child", "parent", 100)
    lru.add("parent", None, 100)
    assert not lru.is_leaf("parent")
    lru.touch("child")
    lru.add("other", None, 100)  # parent is older, but only child can go
    assert "parent" in lru and "child" not in lru


def test_remove_subtree_takes_descendants_only() -> None:
    lru = ChainLRU(10_000)
    lru.add("a", None, 1)
    lru.add("b", "a", 1)
    lru.add("c", "b", 1)
    lru.add("c2", "b", 1)  # a fork: two branches after b
    lru.add("d", "c", 1)
    lru.add("z", None, 1)
    assert sorted(lru.remove_subtree("b")) == ["b", "c", "c2", "d"]
    assert sorted(lru.keys_by_recency()) == ["a", "z"]
    assert lru.total_bytes == 2 and lru.is_leaf("a")


def test_budget_and_leaf_rule_hold_over_a_random_sequence() -> None:
    rng = random.Random(1234)
    budget = 5_000
    lru = ChainLRU(budget)
    evicted_while_parent: list[str] = []
    parents: dict[str, str | None] = {}

    def check_evict(key: str, parent: str | None, nbytes: int) -> None:
        # At eviction time nothing present may name the victim as its parent.
        if any(parents.get(k) == key for k in lru.keys_by_recency()):
            evicted_while_parent.append(key)

    lru.on_evict = check_evict
    heads: list[str] = []
    for step in range(1500):
        op = rng.random()
        present = lru.keys_by_recency()
        if op < 0.6:
            key = f"k{step}"
            parent = rng.choice(present) if present and rng.random() < 0.8 else None
            parents[key] = parent
            lru.add(key, parent, rng.randint(1, 900))
            heads.append(key)
        elif op < 0.85 and present:
            lru.touch(rng.choice(present))
        elif present:
            lru.remove_subtree(rng.choice(present))
        assert lru.total_bytes <= budget
        assert lru.total_bytes == sum(lru.nbytes(k) for k in lru.keys_by_recency())
    assert evicted_while_parent == []
    assert lru.evictions > 50  # the sequence did exercise eviction


# ---- RamTier -------------------------------------------------------------------------------
def test_ram_tier_get_put_and_stats() -> None:
    tier = RamTier(1000)
    assert tier.put("a", None, record_of(400, 1))
    assert tier.get("a").meta == {"fill": "1"}
    assert tier.get("nope") is None
    assert tier.contains("a") and "a" in tier
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["bytes"], stats["entries"]) == (1, 1, 400, 1)


def test_ram_tier_spills_evicted_and_refused_records_with_their_parents() -> None:
    spilled: list[tuple[str, str | None, str]] = []
    tier = RamTier(1000, spill=lambda k, p, r: spilled.append((k, p, r.meta["fill"])))
    tier.put("a1", None, record_of(400, 1))
    tier.put("a2", "a1", record_of(400, 2))
    tier.put("b1", None, record_of(400, 3))  # a2 is the oldest leaf
    assert spilled == [("a2", "a1", "2")]
    tier.put("big", None, record_of(1001, 4))  # larger than the whole tier
    assert spilled[-1] == ("big", None, "4")
    assert not tier.contains("big") and tier.stats()["rejected"] == 1
    assert tier.stats()["spilled"] == 2


def test_ram_tier_discard_leaves_no_hole() -> None:
    tier = RamTier(10_000)
    tier.put("a", None, record_of(10))
    tier.put("b", "a", record_of(10))
    tier.put("c", "b", record_of(10))
    assert tier.discard("b") == 2
    assert tier.contains("a") and not tier.contains("b") and not tier.contains("c")
    assert tier.stats()["bytes"] == 10


def test_ram_tier_spill_may_call_back_into_the_tier() -> None:
    # A spill that reads the tier (as a store put might through stats) must not deadlock.
    tier: RamTier
    seen: list[int] = []
    tier = RamTier(100, spill=lambda k, p, r: seen.append(tier.stats()["entries"]))
    for i in range(5):
        tier.put(i, None, record_of(60))
    assert seen == [1, 1, 1, 1]


def test_ram_tier_is_consistent_under_threads() -> None:
    tier = RamTier(20_000)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(300):
                key = (seed, i)
                tier.put(key, (seed, i - 1) if i else None, record_of(rng.randint(1, 500)))
                tier.get((seed, rng.randint(0, i)))
                assert tier.stats()["bytes"] <= 20_000
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert tier.stats()["bytes"] <= 20_000


@pytest.mark.parametrize("budget", [0, 1])
def test_ram_tier_with_no_room_spills_everything(budget: int) -> None:
    spilled: list[str] = []
    tier = RamTier(budget, spill=lambda k, p, r: spilled.append(k))
    assert not tier.put("a", None, record_of(8))
    assert spilled == ["a"] and tier.get("a") is None


def test_ram_tier_spills_into_the_disk_tier_and_reads_back(tmp_path) -> None:
    from rewind.cache.store import ScratchStore

    store = ScratchStore(tmp_path, 1 << 20)
    try:
        tier = RamTier(3 * 1000, spill=store.put)
        records = {i: record_of(1000, i) for i in range(8)}
        for key, record in records.items():
            tier.put(key, key - 1 if key else None, record)
        store.flush(timeout=30)
        in_ram = [k for k in records if tier.contains(k)]
        on_disk = [k for k in records if store.contains(k)]
        assert len(in_ram) == 3 and sorted(in_ram + on_disk) == list(records)
        for key in on_disk:
            got = store.get(key)
            assert got is not None and got.meta == records[key].meta
            assert bool(mx.array_equal(got.arrays["data"], records[key].arrays["data"]))
    finally:
        store.close()


def test_a_failing_spill_loses_the_record_not_the_put() -> None:
    def broken_spill(key, parent, record) -> None:
        raise OSError("disk tier gone")

    tier = RamTier(100, spill=broken_spill)
    tier.put("a", None, record_of(80))
    assert tier.put("b", None, record_of(80))  # evicts a into the broken spill
    assert tier.contains("b") and not tier.contains("a")
    assert tier.stats()["spill_errors"] == 1 and tier.stats()["spilled"] == 0


def test_an_entry_naming_itself_as_parent_stays_evictable() -> None:
    lru = ChainLRU(100)
    lru.add("self", "self", 60)
    assert lru.add("other", None, 60)
    assert "self" not in lru
