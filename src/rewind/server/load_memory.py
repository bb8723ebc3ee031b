"""What a model takes in memory while it loads and once loaded: estimated before its first load,
measured around every load, and handed back to the OS after an unload.

Memory is measured because estimates alone let the process cross its budget (4.46 GiB RSS under
a 3.51 GiB budget in the churn benchmark): a load reserves its peak, not just what it keeps
(first load: an estimate; then the peak it was measured to reach), is charged the larger of its
estimate and the RSS it added, and an unload waits until the freed memory is back with the OS
before the budget counts it free (settle).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from rewind.models.catalog import Servable
from rewind.models.memory_estimate import estimate_need
from rewind.server.pool_slot import Slot

# The tokenizer's share of a loaded model beyond its weights (parsed vocabulary, merges):
# measured ~6x tokenizer.json for Gemma 3's 262k-token one (33 MB file, ~195 MB resident).
TOKENIZER_FACTOR = 6
# A first load's peak above its header estimate, before it has been measured: half its weight
# files plus the tokenizer's parse once more (the JSON text and the half-built vocabulary are
# freed only after it is done). Measured peaks over the estimate: +0.23 GiB (default, 0.5 GiB
# bf16 file), +0.27 (1B-shaped llama, 1.8 GiB), +0.53 (the default in float32, 1.0 GiB: the CPU
# head's bf16 copy, which headers cannot show). Conservative on purpose: from the second load
# on, the measured peak replaces it.
LOAD_FILE_FRACTION = 2
# A measured peak is reserved with this share on top: loads of the same files peak a few MB
# apart (what the last load left in the heap, page alignment); the churn benchmark without it
# came within 2.7 MB of its budget.
LOAD_PEAK_MARGIN = 32  # 1/32: +67 MB on the 1B-shaped llama's 2.1 GB peak
# An unload's memory is counted free only once RSS stops falling by more than this per try.
SETTLE_BYTES = 8 << 20
SETTLE_TRIES = 5


def tokenizer_bytes(path: Path) -> int:
    """The estimated resident size of the tokenizer a model folder holds (0 for a file)."""
    file = path / "tokenizer.json" if path.is_dir() else None
    return TOKENIZER_FACTOR * file.stat().st_size if file is not None and file.exists() else 0


def need_parts(entry: Servable, slot: Slot | None, backend: str, parallel: int,
               reserve_tokens: int) -> tuple[int, int]:
    """(weights, KV reserve) in bytes: weights as its last load was charged (`slot`), else
    estimated from the files; the reserve is `parallel` sequences of `reserve_tokens`."""
    if not entry.path.exists():
        return 0, 0  # the default, not converted yet: known once converted
    need = estimate_need(entry.path, backend, parallel, reserve_tokens, entry.context_length)
    weights = slot.loaded_bytes if slot is not None and slot.loaded_bytes else (
        need.weights_bytes + tokenizer_bytes(entry.path))
    return weights, need.reserve_bytes


def load_peak(entry: Servable, slot: Slot | None, weights: int) -> int:
    """Bytes a load of `entry` reaches at its peak: measured on an earlier load (`slot`), with
    a margin, else estimated from its files."""
    if slot is not None and slot.peak_bytes:
        return max(slot.peak_bytes + slot.peak_bytes // LOAD_PEAK_MARGIN, weights)
    if not entry.path.exists():
        return weights
    files = entry.path.glob("*.safetensors") if entry.path.is_dir() else [entry.path]
    file_bytes = sum(file.stat().st_size for file in files)
    return weights + file_bytes // LOAD_FILE_FRACTION + tokenizer_bytes(entry.path)


class LoadMeter:
    """RSS around one load: started before it, charged to its slot after."""

    def __init__(self) -> None:
        from rewind.memory import PeakRss, process_rss

        self._before = process_rss()
        self._peak = PeakRss()

    def charge(self, slot: Slot, estimate: int) -> None:
        """Set what the slot is charged while loaded and the peak its load reached."""
        from rewind.memory import process_rss

        # What the OS saw: the RSS the load added (its arrays, its tokenizer, the engine's
        # thread and set-up, kernels' copies outside MLX) and the highest it went meanwhile.
        # Loads run one at a time; a request on another model running meanwhile can only make
        # these larger, which errs on the safe side.
        kept = process_rss() - self._before
        slot.loaded_bytes = max(estimate, kept)
        slot.peak_bytes = max(self._peak.peak() - self._before, slot.loaded_bytes)


def release_freed() -> None:
    """Hand what is already free back: garbage, MLX's buffer cache, glibc's free heap."""
    import mlx.core as mx

    from rewind.memory import release_free_heap

    gc.collect()
    mx.clear_cache()
    release_free_heap(collect=False)


def settle(tries: int = SETTLE_TRIES) -> int:
    """Hand freed memory back until RSS stops falling: the budget then sees what an unload
    really freed, and the next load is admitted against that, not against what the accounting
    hopes. Returns the RSS."""
    from rewind.memory import process_rss

    last = process_rss()
    for _ in range(tries):
        release_freed()
        now = process_rss()
        if last - now < SETTLE_BYTES:
            return now
        last = now
        time.sleep(0.02)
    return last
