"""Block keys: a key names a whole prefix plus everything that makes its cache differ."""

from __future__ import annotations

import random

import pytest

from rewind.cache.blocks import BlockChain, BlockExtras, chain_key, root_key

ROOT = root_key("fingerprint-a", "0:KVCache;1:KVCache")


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 200_000) for _ in range(n)]


def test_keys_are_deterministic_and_distinct() -> None:
    tokens = _tokens(1000)
    first, second = BlockChain(tokens, ROOT), BlockChain(list(tokens), ROOT)
    assert [b.key for b in first.full] == [b.key for b in second.full]
    assert len(first.full) == 3  # 1000 // 256: the 232 tokens after 768 form no full block
    assert len({b.key for b in first.full}) == 3
    assert [(b.start, b.end) for b in first.full] == [(0, 256), (256, 512), (512, 768)]


def test_a_key_chains_its_whole_prefix() -> None:
    tokens = _tokens(1024)
    changed = list(tokens)
    changed[300] += 1  # inside block 1
    before, after = BlockChain(tokens, ROOT), BlockChain(changed, ROOT)
    assert before.full[0].key == after.full[0].key
    # Block 1 and every later block differ, although blocks 2 and 3 hold the same tokens.
    for index in (1, 2, 3):
        assert before.full[index].key != after.full[index].key
    assert before.full[2].tokens == after.full[2].tokens


def test_parents_link_the_chain() -> None:
    chain = BlockChain(_tokens(800), ROOT)
    assert chain.full[0].parent is None and chain.full[0].chained_from == ROOT
    for previous, block in zip(chain.full, chain.full[1:]):
        assert block.parent == previous.key == block.chained_from


@pytest.mark.parametrize(
    "other_root",
    [
        root_key("fingerprint-b", "0:KVCache;1:KVCache"),  # other weights
        root_key("fingerprint-a", "0:RotatingKVCache(max_size=64,keep=4);1:KVCache"),  # layout
        root_key("fingerprint-a", "0:KVCache;1:KVCache", salt="tenant-2"),  # tenant salt
    ],
)
def test_root_parts_change_every_key(other_root: bytes) -> None:
    tokens = _tokens(600)
    assert other_root != ROOT
    ours, theirs = BlockChain(tokens, ROOT), BlockChain(tokens, other_root)
    assert all(a.key != b.key for a, b in zip(ours.full, theirs.full))
    assert ours.at(599).key != theirs.at(599).key


def test_images_change_the_blocks_they_overlap_and_later() -> None:
    tokens = _tokens(1024)
    cat = BlockExtras(image_hashes=[(300, 420, b"cat-sha")])
    dog = BlockExtras(image_hashes=[(300, 420, b"dog-sha")])
    plain, with_cat, with_dog = (BlockChain(tokens, ROOT, e) for e in (None, cat, dog))
    assert plain.full[0].key == with_cat.full[0].key == with_dog.full[0].key
    assert with_cat.full[1].key != with_dog.full[1].key
    assert with_cat.full[1].key != plain.full[1].key
    assert with_cat.full[3].key != with_dog.full[3].key  # chained


def test_an_image_spanning_a_boundary_marks_both_blocks() -> None:
    tokens = _tokens(768)
    a = BlockExtras(image_hashes=[(200, 300, b"a")])
    b = BlockExtras(image_hashes=[(200, 300, b"b")])
    chain_a, chain_b = BlockChain(tokens, ROOT, a), BlockChain(tokens, ROOT, b)
    assert chain_a.full[0].key != chain_b.full[0].key
    # Block 1 folds in its own part of the image, not only its parent's key.
    parent, block1 = chain_a.full[0].key, tuple(tokens[256:512])
    assert chain_key(parent, block1, 256, a, partial=False) != chain_key(
        parent, block1, 256, None, partial=False
    )
    # An image that ends before block 1 leaves block 1's own part alone.
    early = BlockExtras(image_hashes=[(200, 256, b"a")])
    assert chain_key(parent, block1, 256, early, partial=False) == chain_key(
        parent, block1, 256, None, partial=False
    )


def test_partial_points() -> None:
    tokens = _tokens(700)
    chain = BlockChain(tokens, ROOT)
    point = chain.at(650)
    assert point.partial and (point.start, point.end) == (512, 650)
    assert point.chained_from == chain.full[1].key == point.parent
    assert point.tokens == tuple(tokens[512:650])
    # A partial point is keyed by its own tokens: a shorter or different tail gives another key.
    assert chain.at(649).key != point.key
    other = list(tokens)
    other[600] += 1
    assert BlockChain(other, ROOT).at(650).key != point.key
    # The same prefix in a longer prompt gives the same key.
    assert BlockChain(tokens + _tokens(100, seed=1), ROOT).at(650).key == point.key
    # Before the first boundary the point chains from the root and has no parent record.
    early = chain.at(100)
    assert early.partial and early.parent is None and early.chained_from == ROOT
    # A full boundary is the full block itself.
    assert chain.at(512) == chain.full[1] and not chain.at(512).partial


def test_partial_key_never_equals_a_full_key() -> None:
    tokens = _tokens(512)
    chain = BlockChain(tokens, ROOT, block_tokens=128)
    half = BlockChain(tokens, ROOT, block_tokens=256).at(128)  # same tokens, partial
    assert half.partial and half.key != chain.full[0].key


def test_points_outside_the_prompt_are_refused() -> None:
    chain = BlockChain(_tokens(300), ROOT)
    with pytest.raises(ValueError):
        chain.at(0)
    with pytest.raises(ValueError):
        chain.at(301)
