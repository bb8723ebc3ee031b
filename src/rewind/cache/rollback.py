"""Taking the last tokens back out of a sequence's cache (a speculative step's rejected drafts).

A speculative step feeds a row its next input and k drafted tokens in one call, then keeps as
many as the model agreed with. The rest must leave the cache as if they were never fed:
- full attention (KVCache, GrowingKVCache, QuantizedKVCache): the rows past the offset are dead,
  the next update writes over them, so lowering the offset is the whole rollback (mlx-lm's trim);
- a sliding window whose block was written into its full ring in place
  (rewind.cache.window_blocks, the CPU kernels' steps): the rejected keys' slots get their old
  keys back;
- a sliding window (RotatingKVCache) otherwise: a multi-token update leaves the buffer in temporal order,
  the last `window - 1` keys before the call followed by the call's keys (mlx-lm's
  `_update_concat`), so the rejected keys are the buffer's last rows: cutting them off leaves
  exactly the buffer a call of the accepted tokens alone would have left. mlx-lm's own trim
  refuses a window that has wrapped, since in ring order the last rows are not the newest;
- linear attention (a gated-delta layer's ArraysCache) folds every token into one state: its
  call was recorded (rewind.cache.linear_steps), and the kept positions' recurrence runs again
  from the state before it. Other state-space layers cannot give a token back: such a sequence
  does not speculate (`rolls_back` is False).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (ArraysCache, CacheList, KVCache, QuantizedKVCache,
                                  RotatingKVCache)

from rewind.cache import linear_steps
from rewind.cache.kv import GrowingKVCache
from rewind.cache.window_blocks import give_back, held_block

# Caches whose rollback is a lower offset (the rows past it are dead).
TRIMMED_CACHES = (KVCache, GrowingKVCache, QuantizedKVCache)


def rolls_back(layers: list[Any], linear: bool = False) -> bool:
    """Whether every layer cache of a sequence can give back its last tokens. `linear`: the
    model's linear-attention layers record their calls (rewind.cache.linear_steps.install)."""
    return all(_rolls_back(layer, linear) for layer in layers)


def _rolls_back(layer: Any, linear: bool = False) -> bool:
    if type(layer) is CacheList:
        return all(_rolls_back(inner, linear) for inner in layer.caches)
    if type(layer) is ArraysCache:
        return linear
    return type(layer) in TRIMMED_CACHES or (type(layer) is RotatingKVCache and layer.keep == 0)


def roll_back(layers: list[Any], tokens: int) -> None:
    """Take the last `tokens` tokens out of every layer cache. Right after the multi-token
    update that fed them (a sliding window's rollback relies on it); raises ValueError for a
    cache that cannot, before changing any layer."""
    if tokens < 0:
        raise ValueError(f"cannot roll back {tokens} tokens")
    flat = list(linear_steps.leaf_caches(layers))
    if tokens == 0:
        for layer in flat:  # forget the keys a block wrote over: they stay written
            if type(layer) is ArraysCache:
                linear_steps.give_back(layer, 0)
            else:
                give_back(layer, 0)
        return
    for layer in flat:
        if type(layer) is ArraysCache:
            if not linear_steps.can_give_back(layer):
                raise ValueError("a linear-attention layer whose call was not recorded cannot "
                                 "give tokens back")
            continue
        if not _rolls_back(layer):
            raise ValueError(f"a {type(layer).__name__} cannot give tokens back")
        if layer.offset < tokens:
            raise ValueError(f"a cache of {layer.offset} tokens cannot give back {tokens}")
        block = held_block(layer)
        if block and tokens > block:
            raise ValueError(f"a window's block of {block} keys cannot give back {tokens}")
        if (type(layer) is RotatingKVCache and layer._idx != layer.keys.shape[2]
                and not block):
            raise ValueError("a sliding-window cache rolls back only right after a "
                             "multi-token update")
    written: list[Any] = []
    for layer in flat:
        if type(layer) is ArraysCache:
            linear_steps.give_back(layer, tokens)
            continue
        if give_back(layer, tokens):  # a block written into a full window in place
            written += [layer.keys, layer.values]
            continue
        if type(layer) is RotatingKVCache:
            kept = layer._idx - tokens
            layer.keys = layer.keys[..., :kept, :]
            layer.values = layer.values[..., :kept, :]
            layer._idx = kept
            layer.offset -= tokens
        else:
            layer.trim(tokens)
    # The windows' old keys go back now, in the background and in one hand-off to MLX: left to
    # the next step, each layer's read waited for its own write, ~80 us each (30 a step for the
    # default model, 2.4 ms of a 25 ms verifying step).
    if written:
        mx.async_eval(written)
