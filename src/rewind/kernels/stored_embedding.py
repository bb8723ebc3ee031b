"""Lookup tables kept as stored (bf16) on the CPU path, their rows widened as they are read.

The loader widens the floats of models that run MLX's layers to float32. For a lookup-only table
that doubles its memory for nothing: only the rows a prompt reads are ever computed with.
Gemma 4's per-layer input embeddings are the largest case (262,144 x 35 x 256 for E2B: 4.7 GB
in bf16, 9.4 GB widened). `use_in_model` swaps such `nn.Embedding`s for a `StoredEmbedding`
that keeps the bf16 table and returns float32 rows, the values the widened table would give.
Tables that may also serve as the output head (`embed_tokens`, tied to it in many families) are
left to the loader's widening and the fast head (rewind.kernels.fast_head).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

HEAD_CAPABLE = frozenset({"embed_tokens", "wte", "tok_embeddings"})


class StoredEmbedding(nn.Module):
    """nn.Embedding's lookup over a table kept in its stored dtype; float32 rows out."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        # Outside the parameter tree (a leading underscore): the loader's float32 widening must
        # leave the stored table alone.
        self._table = embedding.weight
        self.num_embeddings, self.dims = (int(n) for n in embedding.weight.shape)

    def __call__(self, ids: mx.array) -> mx.array:
        return self._table[ids].astype(mx.float32)

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)


def use_in_model(model: Any) -> int:
    """Swap each bf16 lookup-only `nn.Embedding` of `model` for a StoredEmbedding; returns how
    many."""
    swaps = [(module, name, child) for _, module in model.named_modules()
             for name, child in module.children().items()
             if type(child) is nn.Embedding and name not in HEAD_CAPABLE
             and child.weight.dtype == mx.bfloat16]
    for owner, name, embedding in swaps:
        owner[name] = StoredEmbedding(embedding)
    return len(swaps)
