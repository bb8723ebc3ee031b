"""PromptCache: restore the longest cached prefix of a prompt, checkpoint new blocks.

What a restore at point b needs (see records.py):
  kv      the spine records of every block from the first up to b (the full-attention deltas);
  window  the window records of the blocks whose rows the sliding windows at b hold: the last
          few before b, and the first (for `keep` sink rows);
  state   the state record at b.
Points are full block boundaries (multiples of block_tokens) and partial points (a prompt's
end, where the next turn diverges). A partial point's spine record holds the rows from the last
full boundary to the point and chains from that boundary's key.

Record keys in the tiers: the spine record under the block key itself, its window and state
records under the block key plus one tag byte. The tiers' chain-aware LRU sees spine records
chained to the previous block and window/state records as children of their own block, so old
blocks' window rows and old points' states go first (to disk, where there is one) and a chain
never loses a block in its middle.

The prompt cache never raises into the engine for a storage problem: a record that is missing,
corrupt or fails its identity check only shortens the restored prefix.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from rewind.cache import records as rec
from rewind.cache.blocks import (
    BlockChain,
    BlockExtras,
    BlockIdentity,
    images_digest,
    root_key,
)
from rewind.cache.kv import make_cache
from rewind.cache.ram_tier import RamTier
from rewind.cache.serialize import Record
from rewind.cache.shared_tiers import SharedTiers, open_store
from rewind.config import CacheConfig

log = logging.getLogger(__name__)

_TAG = {rec.WINDOW: b"w", rec.STATE: b"s"}  # the records beside a block's spine record
_MAX_PARTIAL_POINTS = 1 << 16  # bound on the in-memory index of partial checkpoints
_MAX_RESTORE_ATTEMPTS = 4  # a failing record shortens the plan; give up after this many
_PARTIAL_NOTE = b"p"  # a persistent store's note on a partial point's spine record


@dataclass
class Restored:
    """A restore's result: live caches holding tokens[:tokens], and where they came from."""

    cache: list
    tokens: int  # prompt tokens restored; prefill tokens[tokens:]
    ram_tokens: int
    disk_tokens: int
    seconds: float


@dataclass
class _Point:
    """A candidate restore point and the record keys it needs, in chain order."""

    identity: BlockIdentity
    spine: list[BlockIdentity]  # every spine block from the first up to the point
    windows: list[int]  # indices into `spine` of the blocks whose window records it needs


class PromptCache:
    """Checkpoints and restores prompt prefixes of one model across requests."""

    def __init__(self, model: Any, fingerprint: str, config: CacheConfig | None = None,
                 tiers: SharedTiers | None = None) -> None:
        # `model` may be swapped (or set to None while the model is unloaded, see
        # rewind.server.model_pool): the records and the partial-point index outlive it.
        self.model = model
        self.fingerprint = fingerprint
        self.config = config or CacheConfig()
        self.block_tokens = self.config.block_tokens
        self._lock = threading.RLock()  # the engine thread is the user; tests may add more
        self._partials: dict[bytes, set[int]] = {}  # chained_from key -> partial lengths
        self._partial_notes: dict[bytes, bytes] = {}  # spine key -> note (write-through only)
        self._partial_count = 0
        self.disabled_reason: str | None = None if self.config.enabled else "disabled by config"
        # `tiers`: one RAM tier and one disk file shared by several models' caches (block keys
        # carry the model's fingerprint, so records of different models never collide).
        self._shared = tiers is not None
        if tiers is not None:
            self.store = tiers.store if self.config.enabled else None
            self.ram = tiers.ram
        else:
            self.store = open_store(self.config) if self.config.enabled else None
            self.ram = RamTier(self.config.ram_bytes, spill=self._spill)
        # A persistent store writes every record through as it is made (a kill loses only the
        # newest), and brings back the partial points of an earlier process.
        self.write_through = bool(self.store is not None and self.store.persistent)
        if self.write_through:
            self.store.note_model(fingerprint)
            self._reload_partials()
        self._counters = {
            "restores": 0,
            "tokens_requested": 0,
            "tokens_restored": 0,
            "tokens_restored_ram": 0,
            "tokens_restored_disk": 0,
            "tokens_recomputed": 0,
            "checkpoints": 0,
            "records_stored": 0,
            "points_past_ram": 0,  # points whose chain is larger than the RAM tier: disk only
            "identity_mismatches": 0,
            "missing_records": 0,
            "restore_errors": 0,
            "unsupported_checkpoints": 0,
            "blocks_past_window": 0,  # blocks a checkpoint could no longer take from a window
        }
        self._restore_seconds = 0.0

    # ---- the engine's API --------------------------------------------------------------------

    def restore(
        self,
        tokens: Sequence[int],
        extras: BlockExtras | None = None,
        max_kv_size: int | None = None,
    ) -> Restored:
        """Live caches for the longest restorable prefix of `tokens`, leaving >= 1 token."""
        started = time.perf_counter()
        with self._lock:
            template = make_cache(self.model, max_kv_size=max_kv_size)
            try:
                restored = self._restore_into(template, list(tokens), extras)
            except (KeyError, ValueError) as error:
                # Records that pass their checks but do not fit this model's caches (a bug or
                # a stale format): recompute rather than fail the request.
                log.warning("prompt-cache restore failed, recomputing: %s", error)
                self._counters["restore_errors"] += 1
                fresh = make_cache(self.model, max_kv_size=max_kv_size)
                restored = Restored(cache=fresh, tokens=0, ram_tokens=0, disk_tokens=0, seconds=0.0)
            seconds = time.perf_counter() - started
            restored.seconds = seconds
            counters = self._counters
            counters["restores"] += 1
            counters["tokens_requested"] += len(tokens)
            counters["tokens_restored"] += restored.tokens
            counters["tokens_restored_ram"] += restored.ram_tokens
            counters["tokens_restored_disk"] += restored.disk_tokens
            counters["tokens_recomputed"] += len(tokens) - restored.tokens
            self._restore_seconds += seconds
            return restored

    def checkpoint(
        self, tokens: Sequence[int], cache: Sequence[Any], extras: BlockExtras | None = None
    ) -> None:
        """Store records for every block of `tokens` not cached yet, and for the point
        len(tokens) itself. `cache` must hold exactly `tokens`."""
        with self._lock:
            if self.disabled_reason is not None or not tokens:
                return
            try:
                root = self._root(cache, extras)
            except rec.UnsupportedCacheError as error:
                # Not fatal for the cache as a whole: the caller may have handed a batched
                # cache by mistake. A model whose own caches are unsupported is turned off
                # by restore(), which builds them from make_cache.
                self._counters["unsupported_checkpoints"] += 1
                log.warning("checkpoint skipped: %s", error)
                return
            offset = rec.cache_offset(cache)
            if offset is not None and offset != len(tokens):
                raise ValueError(f"checkpoint: the cache holds {offset} tokens, not {len(tokens)}")
            self._counters["checkpoints"] += 1
            chain = BlockChain(tokens, root, extras, self.block_tokens)
            point = chain.at(len(tokens))
            spine = [block for block in chain.full if block.end <= point.start]
            spine.append(point)  # a full point is the last full block itself
            new: list[tuple[bytes, bytes | None, Record]] = []
            for block in spine:
                try:
                    new += self._block_records(cache, block, extras)
                except rec.RowsGoneError as error:
                    # Store what comes before it: a chain never gets a block it cannot
                    # rebuild, and a later prefill that passes this block stores it whole.
                    self._counters["blocks_past_window"] += 1
                    log.info("checkpoint stops at %d: %s", block.start, error)
                    self._store(new, spine)
                    return
            key = point.key + _TAG[rec.STATE]
            if not self._has(key):
                record = rec.snapshot_state(cache, point.end)
                if record is not None:
                    new.append((key, point.key, record))
            if point.partial:
                self._remember_partial(point)
            self._store(new, spine)

    def _block_records(self, cache: Sequence[Any], block: BlockIdentity,
                       extras: BlockExtras | None) -> list[tuple[bytes, bytes | None, Record]]:
        """The spine and window records of `block` not stored yet (a window record may have
        been evicted while its block stayed). RowsGoneError when the window rows are gone."""
        records: list[tuple[bytes, bytes | None, Record]] = []
        window_key = block.key + _TAG[rec.WINDOW]
        if not self._has(window_key):
            window = rec.snapshot_window(cache, block)
            if window is not None:
                records.append((window_key, block.key, window))
        if not self._has(block.key):
            images = images_digest(extras, block.start, block.end)
            records.insert(0, (block.key, block.parent, rec.snapshot_kv(cache, block, images)))
        return records

    def _store(self, new: list[tuple[bytes, bytes | None, Record]], spine: list[BlockIdentity]) -> None:
        """Put one point's new records into RAM, or straight to disk when the point's whole
        chain cannot fit in RAM: admitting part of it would only evict older points that RAM
        can restore in favour of records it cannot use."""
        self._counters["records_stored"] += len(new)
        fresh = {key: record.nbytes for key, _, record in new}
        needed = sum(fresh.values())
        for block in spine:
            if block.key not in fresh:
                held = self.ram.peek(block.key)
                needed += held.nbytes if held is not None else 0
        if self.write_through:
            for key, parent, record in new:
                self.store.put(key, parent, record, self._partial_notes.get(key, b""))
            self._partial_notes.clear()
        if needed > self.ram.budget_bytes:
            self._counters["points_past_ram"] += 1
            for key, parent, record in new:
                self._spill(key, parent, record)
            return
        for key, parent, record in new:
            self.ram.put(key, parent, record)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "enabled": self.disabled_reason is None,
                "disabled_reason": self.disabled_reason,
                **self._counters,
                "restore_seconds": self._restore_seconds,
                "partial_points": self._partial_count,
                "ram": self.ram.stats(),
                "disk": self.store.stats() if self.store is not None else None,
            }

    def point_keys(
        self, tokens: Sequence[int], extras: BlockExtras | None = None, max_kv_size: int | None = None
    ) -> dict[str, bytes]:
        """Tier keys of the records at point len(tokens): "kv" (the spine record of its block),
        "window" (its window rows) and "state" (for inspection, tests and debugging)."""
        template = make_cache(self.model, max_kv_size=max_kv_size)
        chain = BlockChain(tokens, self._root(template, extras), extras, self.block_tokens)
        key = chain.at(len(tokens)).key
        return {rec.KV: key, rec.WINDOW: key + _TAG[rec.WINDOW], rec.STATE: key + _TAG[rec.STATE]}

    def flush(self) -> None:
        """Wait until every record handed to the disk tier is written (tests, benchmarks)."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        with self._lock:
            if self._shared:  # the tiers belong to their SharedTiers, which closes them
                self.store = None
                return
            self.ram.spill = None  # shutting down: nothing more goes to disk
            self.ram.clear()
            if self.store is not None:
                self.store.close()
                self.store = None

    # ---- planning and restoring --------------------------------------------------------------

    def _root(self, cache: Sequence[Any], extras: BlockExtras | None) -> bytes:
        salt = self.config.salt + "\x00" + (extras.salt if extras else "")
        return root_key(self.fingerprint, rec.describe_layout(cache), salt)

    def _restore_into(
        self, template: list, tokens: list[int], extras: BlockExtras | None
    ) -> Restored:
        nothing = Restored(cache=template, tokens=0, ram_tokens=0, disk_tokens=0, seconds=0.0)
        if self.disabled_reason is not None or len(tokens) < 2:
            return nothing
        try:
            root = self._root(template, extras)
            needs = rec.kinds_in(template) & {rec.STATE}
        except rec.UnsupportedCacheError as error:
            self.disabled_reason = str(error)
            return nothing
        chain = BlockChain(tokens, root, extras, self.block_tokens)
        limit = len(tokens) - 1  # the last token is always computed: its logits are sampled
        for _ in range(_MAX_RESTORE_ATTEMPTS):
            point = self._plan(chain, limit, needs, template)
            if point is None:
                return nothing
            loaded = self._load(point, needs, extras, template)
            if isinstance(loaded, int):
                limit = loaded  # a record failed: plan again, ending at or before its block
                continue
            parts, ram_tokens, disk_tokens = loaded
            # On a GPU, one concatenation for every layer's blocks: each copy is a kernel MLX
            # encodes on the host, one a block, layer and kind otherwise (rewind.cache.records).
            # The CPU copies the bytes themselves, and would copy each layer again at its first
            # write.
            cache = rec.rebuild(template, parts, joined=mx.default_device() != mx.cpu)
            return Restored(cache, point.identity.end, ram_tokens, disk_tokens, 0.0)
        return nothing

    def _plan(self, chain: BlockChain, limit: int, needs: set[str],
              template: list) -> _Point | None:
        """The furthest point <= limit whose records are all present in RAM or on disk."""
        present: list[BlockIdentity] = []
        for block in chain.full:
            if block.end > limit or not self._has(block.key):
                break
            present.append(block)
        candidates: list[tuple[int, BlockIdentity, int]] = []  # (end, point, spine blocks)
        for index, block in enumerate(present):
            candidates.append((block.end, block, index + 1))
        for index in range(len(present) + 1):
            aligned_key = chain.root if index == 0 else present[index - 1].key
            for length in self._partials.get(aligned_key, ()):
                end = index * self.block_tokens + length
                if end <= limit:
                    point = chain.at(end)
                    candidates.append((end, point, index))
        for _, point, spine_blocks in sorted(candidates, key=lambda c: c[0], reverse=True):
            if point.partial and not self._has(point.key):
                continue
            if not all(self._has(point.key + _TAG[kind]) for kind in needs):
                continue
            spine = present[:spine_blocks] + ([point] if point.partial else [])
            windows = self._window_blocks(template, spine, point.end)
            if all(self._has(spine[i].key + _TAG[rec.WINDOW]) for i in windows):
                return _Point(point, spine, windows)
        return None

    @staticmethod
    def _window_blocks(template: list, spine: list[BlockIdentity], end: int) -> list[int]:
        return rec.window_blocks(template, [(block.start, block.end) for block in spine], end)

    def _load(
        self, point: _Point, needs: set[str], extras: BlockExtras | None, template: list
    ) -> tuple[rec.RestoreParts, int, int] | int:
        """Fetch and check the records of `point`; on failure, the start of the failing block
        (a restore must end at or before it)."""
        spine_records: list[Record] = []
        block_from_disk: list[bool] = []
        for block in point.spine:
            record, from_disk = self._get(block.key, block.parent)
            if record is None:
                self._counters["missing_records"] += 1
                return block.start
            if not rec.verify_kv(record, block, images_digest(extras, block.start, block.end)):
                self._counters["identity_mismatches"] += 1
                self._discard(block.key)
                return block.start
            spine_records.append(record)
            block_from_disk.append(from_disk)
        windows: list[Record] = []
        for index in point.windows:
            block = point.spine[index]
            record, from_disk = self._get(block.key + _TAG[rec.WINDOW], block.key)
            if (record is None or record.meta.get("kind") != rec.WINDOW
                    or record.meta.get("end") != str(block.end)):
                self._counters["missing_records"] += 1
                return point.identity.end - 1  # plan again: an earlier point may not need it
            windows.append(record)
            block_from_disk[index] = block_from_disk[index] or from_disk
        state: Record | None = None
        end = point.identity.end
        if rec.STATE in needs:
            record, from_disk = self._get(point.identity.key + _TAG[rec.STATE], point.identity.key)
            if (record is None or record.meta.get("kind") != rec.STATE
                    or record.meta.get("end") != str(end)):
                self._counters["missing_records"] += 1
                return end - 1  # plan again for an earlier point
            state = record
            if from_disk and block_from_disk:
                block_from_disk[-1] = True  # the point's state came from disk
        parts = rec.RestoreParts(end=end, kv=spine_records, state=state, window=windows)
        if not rec.window_covered(template, parts):
            # A window row in no record (a record from another layout, a bug): recompute.
            self._counters["missing_records"] += 1
            return end - 1
        sizes = [block.end - block.start for block in point.spine]
        disk_tokens = sum(size for size, disk in zip(sizes, block_from_disk) if disk)
        ram_tokens = sum(sizes) - disk_tokens
        return parts, ram_tokens, disk_tokens

    # ---- the tiers --------------------------------------------------------------------------

    def _has(self, key: bytes) -> bool:
        if self.ram.contains(key):
            return True
        return self.store is not None and self.store.contains(key)

    def _get(self, key: bytes, parent: bytes | None) -> tuple[Record | None, bool]:
        """(record, came from disk); a disk hit is promoted into the RAM tier."""
        record = self.ram.get(key)
        if record is not None:
            return record, False
        if self.store is None:
            return None, False
        record = self.store.get(key)
        if record is None:
            return None, False
        self.ram.put(key, parent, record)
        return record, True

    def _spill(self, key: Any, parent: Any, record: Record) -> None:
        """RAM evicted a record: keep it on disk (once), if there is a disk tier."""
        store = self.store
        if store is None or store.contains(key):
            return
        store.put(key, parent, record)

    def _discard(self, key: bytes) -> None:
        self.ram.discard(key)
        if self.store is not None:
            self.store.discard(key)

    def _reload_partials(self) -> None:
        """The partial points whose spine records a persistent store brought back."""
        for _key, _parent, note in self.store.notes():
            if note[:1] == _PARTIAL_NOTE and len(note) > 5:
                (length,) = struct.unpack_from("<I", note, 1)
                lengths = self._partials.setdefault(bytes(note[5:]), set())
                if length not in lengths:
                    lengths.add(length)
                    self._partial_count += 1

    def _remember_partial(self, point: BlockIdentity) -> None:
        if self.write_through:
            self._partial_notes[point.key] = (_PARTIAL_NOTE + struct.pack("<I", len(point.tokens))
                                              + point.chained_from)
        lengths = self._partials.setdefault(point.chained_from, set())
        if len(point.tokens) not in lengths:
            if self._partial_count >= _MAX_PARTIAL_POINTS:
                self._partials.clear()  # rare; costs only partial hits until they come back
                self._partial_count = 0
                lengths = self._partials.setdefault(point.chained_from, set())
            lengths.add(len(point.tokens))
            self._partial_count += 1


# ---- the reference driver ------------------------------------------------------------------------
