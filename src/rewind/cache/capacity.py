"""How many rows a full-attention KV buffer holds for a given number of tokens: one ladder, shared
by the caches that allocate (rewind.cache.kv, the prompt cache's restore) and by the memory
budget that accounts for them before they do (rewind.models.memory_estimate).

The ladder, in 256-row steps: 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, ...
(powers of two and 1.5x powers of two). Why these:
- every rung is a multiple of 256, which MLX's CUDA backend needs for its fused decode attention;
- consecutive rungs differ by a factor of 1.33 to 1.5, so a growth copies the buffer once per
  a third of its rows or more: an appended token costs the same at 8k as at 512, where growing
  256 rows at a time (mlx-lm) copies the whole buffer every 256 tokens;
- the capacity depends on the token count alone, not on how the tokens arrived (chunk sizes,
  a restore), so the budget can count exactly what a cache holds; past 512 rows at most a
  third of a buffer is spare (doubling would leave up to half).

Pure Python, no MLX: the memory estimate imports it.
"""

from __future__ import annotations

STEP = 256  # capacities are multiples of this (mlx-lm's KVCache.step; MLX CUDA's kv_cache_step)


def round_up(rows: int) -> int:
    return -(-rows // STEP) * STEP


def capacity_for(rows: int) -> int:
    """The smallest rung of the ladder that holds `rows` (at least one step)."""
    steps = max(1, -(-rows // STEP))
    power = 1 << (steps - 1).bit_length()  # the smallest power of two >= steps
    if power >= 4 and steps <= power * 3 // 4:
        return power * 3 // 4 * STEP
    return power * STEP


def next_capacity(needed: int, bound: int | None = None) -> int:
    """The capacity to allocate for `needed` rows: the ladder's rung, or less where `bound` (the
    most rows the cache will ever hold, when known) says the rung's spare rows would never be
    used; never less than round_up(needed)."""
    capacity = capacity_for(needed)
    if bound is not None:
        capacity = min(capacity, max(round_up(needed), round_up(bound)))
    return capacity


def ladder(rows: int) -> list[int]:
    """Every rung up to the one that holds `rows`, smallest first."""
    top = capacity_for(max(rows, 1))
    return sorted({capacity_for(n) for n in range(STEP, top + 1, STEP)})
