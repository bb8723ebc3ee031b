"""Chained 256-token block keys: what identifies a cached prefix.

A prompt is cut into blocks of `block_tokens` tokens. Block i's key hashes the key of block i-1,
the block's own tokens and its extras (hashes of images overlapping the block), so a key names a
whole prefix, not just one block. The chain starts from a root key that folds in everything that
makes two caches of the same tokens differ: the model's fingerprint, the shape of its cache
(layer classes, window sizes) and the tenant's salt.

A checkpoint that does not fall on a block boundary (the end of a prompt, where the next turn
diverges) gets a partial key: the last full block's key hashed with the partial tokens, under a
different domain tag so a partial key can never equal a full one.

Hashes are BLAKE2b-128: fast enough (a block is 1 KiB of token ids) and collision resistant even
against crafted prompts, which matters once a salt separates tenants. Records still carry their
tokens and parent key, checked on every hit (see `BlockIdentity`), so even a collision could not
return a wrong cache.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from rewind.config import BLOCK_TOKENS

KEY_BYTES = 16
_VERSION = b"rewind-prompt-cache-v1"


@dataclass(frozen=True)
class BlockExtras:
    """What besides token ids goes into a block's key.

    image_hashes: (start, end, digest) spans of image tokens in the prompt; an image's digest is
    folded into every block its span overlaps, so the same placeholder tokens with another
    picture never hit. salt: a per-tenant string, so tenants never share cache entries."""

    image_hashes: list[tuple[int, int, bytes]] = field(default_factory=list)
    salt: str = ""


def _hasher() -> "hashlib._Hash":
    return hashlib.blake2b(digest_size=KEY_BYTES)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    # Fixed-width little-endian ids: unambiguous, and the same on every machine.
    return np.asarray(tokens, dtype="<u4").tobytes()


def root_key(fingerprint: str, layout: str, salt: str = "") -> bytes:
    """The chain's origin: model fingerprint, cache layout and tenant salt."""
    digest = _hasher()
    for part in (_VERSION, fingerprint.encode(), layout.encode(), salt.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


def _images_in(extras: BlockExtras | None, start: int, end: int) -> bytes:
    if extras is None:
        return b""
    parts = [
        img_start.to_bytes(8, "little") + img_end.to_bytes(8, "little") + digest
        for img_start, img_end, digest in extras.image_hashes
        if img_start < end and img_end > start  # overlaps [start, end)
    ]
    return b"".join(parts)


def images_digest(extras: BlockExtras | None, start: int, end: int) -> str:
    """The images overlapping [start, end), as a hex digest a record keeps for its identity
    check (the salt and the fingerprint are in the root key, which the chain carries)."""
    digest = _hasher()
    digest.update(_images_in(extras, start, end))
    return digest.hexdigest()


def chain_key(
    parent: bytes, tokens: Sequence[int], start: int, extras: BlockExtras | None, partial: bool
) -> bytes:
    """Key of the block holding `tokens` at positions [start, start + len(tokens))."""
    digest = _hasher()
    digest.update(b"P" if partial else b"F")
    digest.update(parent)
    digest.update(len(tokens).to_bytes(4, "little"))
    digest.update(_token_bytes(tokens))
    digest.update(_images_in(extras, start, start + len(tokens)))
    return digest.digest()


@dataclass(frozen=True)
class BlockIdentity:
    """One checkpoint point of a prompt: its key, the key it chains from, its span and tokens."""

    key: bytes
    chained_from: bytes  # the previous full block's key, or the root for the first block
    start: int
    end: int
    tokens: tuple[int, ...]
    partial: bool
    is_first: bool  # chained from the root: no parent record

    @property
    def parent(self) -> bytes | None:
        """The parent record's key for the tiers' chain-aware LRU (None: nothing before it)."""
        return None if self.is_first else self.chained_from


class BlockChain:
    """The block keys of one prompt, computed once and reused by plan, restore and checkpoint.

    full[i] is the block ending at (i + 1) * block_tokens; partial(end) keys a checkpoint at a
    position that is not a multiple of block_tokens."""

    def __init__(
        self,
        tokens: Sequence[int],
        root: bytes,
        extras: BlockExtras | None = None,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        self.tokens = list(tokens)
        self.root = root
        self.extras = extras
        self.block_tokens = block_tokens
        self.full: list[BlockIdentity] = []
        parent = root
        for start in range(0, len(self.tokens) - block_tokens + 1, block_tokens):
            block = tuple(self.tokens[start : start + block_tokens])
            key = chain_key(parent, block, start, extras, partial=False)
            self.full.append(
                BlockIdentity(key, parent, start, start + block_tokens, block, False, start == 0)
            )
            parent = key

    def aligned_parent(self, end: int) -> bytes:
        """Key of the last full block at or before `end` (the root when there is none)."""
        index = end // self.block_tokens
        return self.root if index == 0 else self.full[index - 1].key

    def at(self, end: int) -> BlockIdentity:
        """The checkpoint identity ending at `end` (full when end is a multiple of block_tokens)."""
        if not 0 < end <= len(self.tokens):
            raise ValueError(f"checkpoint end {end} outside the prompt (1..{len(self.tokens)})")
        if end % self.block_tokens == 0:
            return self.full[end // self.block_tokens - 1]
        start = end - end % self.block_tokens
        parent = self.aligned_parent(end)
        block = tuple(self.tokens[start:end])
        key = chain_key(parent, block, start, self.extras, partial=True)
        return BlockIdentity(key, parent, start, end, block, True, start == 0)
