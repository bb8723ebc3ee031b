"""A prompt call's attention at shapes that repeat, for MLX's CUDA backend.

MLX runs a prompt call's attention (more than one query) through cuDNN where the head size
allows (up to 128), and builds a cuDNN graph for every new combination of query and key shapes
and strides (`SDPACacheKey` in its scaled_dot_product_attention.cpp, 0.32): ~36 ms for 32 heads
of 64 on an H100, 0.1 ms once built (benchmarks/results/gpu/new-shapes-h100-733dff2.txt). In a
conversation that grows turn by turn, nearly every prompt call has a key length the process
never saw (the conversation's length so far), so nearly every call builds one, while the other
sessions' decode steps wait behind it. Head sizes cuDNN does not take go to MLX's matmul path,
whose cuBLAS plans are chosen per shape too.

Here a call of L queries over a cache of n tokens attends with
- the queries padded with zeros to L rounded up to 256 (the GPU's prompt calls are at most 256
  tokens by default, so one count: padding a 7-token tail costs at most a full chunk's
  attention, ~1 ms at 9k keys for 16 layers of Llama-3.2-1B, where a new graph cost 36),
- the keys and values read as the buffer's first `cache.ladder_rows(n)` rows (the rung of
  rewind.cache.capacity's ladder that holds n, a function of n alone, so a cold and a cached
  turn read the same shapes), under an additive mask: query i of the call (absolute position n - L + i) sees keys
  0..n - L + i, a padded query every real key (its row is dropped),
so the shapes are the ladder's rungs, and the graphs are few enough to build at load
(`warm_graphs`, on the thread that serves: MLX keeps them per thread,
rewind.engine.model_thread). The keys past n weigh exactly 0 (exp(-inf)), so a query's
softmax sums the same terms, and a call's shapes depend on L and n alone: a cold and a cached
turn compute the same call alike.

Taken for a plain prompt call only, of a head shape cuDNN takes: a cache with `ladder_rows` (rewind.cache.kv.GrowingKVCache,
a batch-1 prompt call's; kernels do not import the cache package) whose buffer holds the rung, a "causal" mask, no sinks, keys as the cache's own slice.
`REWIND_PROMPT_SHAPES=off` keeps MLX's exact shapes (read at each call).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx

from rewind import env
from rewind.config import GPU_CHUNK_TOKENS

# Queries are padded to a multiple of the GPU's prompt-call grid, so a call has one padded count.
QUERY_BUCKET = GPU_CHUNK_TOKENS
# Per thread (a model's engines run on its own thread, rewind.engine.model_thread): the mask a
# call's layers share (`last`: one per call, not one per layer), and the (dtype, query heads,
# key-value heads, head size) of the calls padded (`seen`), which `warm_graphs` builds for.
_local = threading.local()


def seen() -> set[tuple[mx.Dtype, int, int, int]]:
    """The head shapes this thread padded."""
    if not hasattr(_local, "seen"):
        _local.seen = set()
    return _local.seen


def query_bucket(queries: int) -> int:
    """The padded query count for a call of `queries` tokens."""
    if queries <= 0:
        raise ValueError(f"a prompt call has at least one query, not {queries}")
    return -(-queries // QUERY_BUCKET) * QUERY_BUCKET


def takes(cache: Any, keys: mx.array, mask: Any, sinks: Any) -> bool:
    """Whether this attention call is a plain prompt call this module pads."""
    ladder_rows = getattr(cache, "ladder_rows", None)
    if (sinks is not None or not isinstance(mask, str) or mask != "causal"
            or ladder_rows is None or env.prompt_shapes_off()):
        return False
    buffer, value_buffer = cache.keys, cache.values
    tokens = cache.offset
    return (buffer is not None and value_buffer is not None and isinstance(tokens, int)
            and 0 < keys.shape[2] == tokens and buffer.shape[:2] == keys.shape[:2]
            and value_buffer.shape == buffer.shape
            and buffer.shape[2] >= ladder_rows(tokens)
            and _cudnn_takes(buffer.dtype, buffer.shape[3]))


def additive_mask(queries: int, tokens: int, width: int, dtype: mx.Dtype) -> mx.array:
    """[1, 1, padded queries, width]: 0 where query i (position tokens - queries + i) may look,
    -inf elsewhere; padded queries look at every real key."""
    if not 0 < queries <= tokens <= width:
        raise ValueError(f"{queries} queries of a cache of {tokens} tokens read as {width}")
    padded = query_bucket(queries)
    key = (queries, tokens, width, dtype)
    memo = getattr(_local, "last", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    rows = mx.arange(padded, dtype=mx.int32)
    last_key = mx.minimum(rows + (tokens - queries), tokens - 1)
    visible = mx.arange(width, dtype=mx.int32)[None, :] <= last_key[:, None]
    mask = mx.where(visible, mx.array(0.0, dtype), mx.array(-float("inf"), dtype))
    mask = mask.reshape(1, 1, padded, width)
    _local.last = (key, mask)
    return mask


def attention(queries: mx.array, cache: Any, scale: float) -> mx.array:
    """The call's attention output [B, Hq, L, D], computed at the padded shapes (a cache that
    `takes` accepted)."""
    count = queries.shape[2]
    tokens = cache.offset
    padded, width = query_bucket(count), cache.ladder_rows(tokens)
    seen().add((queries.dtype, queries.shape[1], cache.keys.shape[1], queries.shape[3]))
    if padded > count:
        filler = mx.zeros((*queries.shape[:2], padded - count, queries.shape[3]), queries.dtype)
        queries = mx.concatenate([queries, filler], axis=2)
    else:  # the same layout as a padded call's (cuDNN's graphs are keyed by strides too)
        queries = mx.contiguous(queries)
    keys = cache.keys[..., :width, :]
    values = cache.values[..., :width, :]
    mask = additive_mask(count, tokens, width, queries.dtype)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return out[:, :, :count, :] if padded > count else out


def _cudnn_takes(dtype: mx.Dtype, dim: int) -> bool:
    """Whether MLX's CUDA backend gives such a call to cuDNN (head size a multiple of 8, at
    most 128, half precision). Others take its matmul path, which would compute and hold the
    padded scores whole ([heads, 256, rung]: ~1 GiB a layer for 16 heads at 100k tokens), so
    they keep their exact shapes."""
    return dim % 8 == 0 and dim <= 128 and dtype in (mx.bfloat16, mx.float16)


def warm_graphs(rungs: list[int]) -> int:
    """Build the graphs of a full call (QUERY_BUCKET queries) reading each of `rungs` rows
    (the KV ladder's rungs up to the context served, rewind.cache.capacity) for each head shape
    this thread padded so far; run on the thread that will serve. Returns the calls made. ~36
    ms a graph on an H100 (18 rungs to 131,072 tokens)."""
    calls = 0
    for dtype, heads, kv_heads, dim in sorted(seen(), key=str):
        if not _cudnn_takes(dtype, dim):
            continue
        queries = mx.zeros((1, heads, QUERY_BUCKET, dim), dtype)
        for rung in rungs:
            if rung < QUERY_BUCKET:
                continue
            buffer = mx.zeros((1, kv_heads, rung, dim), dtype)
            mx.eval(mx.fast.scaled_dot_product_attention(
                queries, buffer, buffer, scale=dim ** -0.5,
                mask=additive_mask(QUERY_BUCKET, rung, rung, dtype)))
            calls += 1
    return calls
