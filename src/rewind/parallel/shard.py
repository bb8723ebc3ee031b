"""Splitting a loaded model over the ranks of a group.

Tensor parallelism (the default): mlx-lm's own `model.shard(group)` where the family has one
(llama, mistral, qwen2, qwen3, ...), the layout `mlx_lm.utils.sharded_load` applies: attention
heads and MLP columns split, the second projection of each summed over the ranks. Gemma 3 has
none in mlx-lm, so `_shard_gemma3` applies the same layout; its small models have a single
key/value head (Gemma 3 270M: 4 query heads, 1 KV head), which cannot be split, so there every
rank keeps the whole K/V projection and the query heads are split (as vLLM does past the KV
head count).

Pipeline parallelism (--pipeline): mlx-lm's `model.model.pipeline(group)` where the family has
one (mlx-lm 0.32: qwen3_5, qwen3_next, ministral3, deepseek_v41, ...): each rank runs a
contiguous slice of the layers (rank 0 the last ones) and holds only those layers' caches; the
hidden states go from stage to stage by send/recv, and an all_gather gives every rank the last
stage's output, so every rank computes the same logits. Other families raise ShardingError.

The model must run MLX's layers (not Rewind's C forward, which bypasses the sharded projections);
the caller loads it with native_forward="off".
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.nn.layers.distributed import shard_linear

LAYOUTS = ("tensor", "pipeline")


class ShardingError(ValueError):
    """The model cannot be split this way over this many ranks."""


def shard_model(model: Any, group: mx.distributed.Group, layout: str) -> None:
    """Split `model` in place for this rank, then load its shard's weights."""
    if layout == "pipeline":
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise ShardingError(
                f"mlx-lm's {model_type(model)} has no pipeline layout (model.model.pipeline()); "
                "run it tensor-parallel (without --pipeline). Installed mlx-lm has one for: "
                f"{', '.join(pipeline_families()) or 'none'}")
        try:
            inner.pipeline(group)
        except ValueError as exc:  # e.g. more ranks than layers
            raise ShardingError(f"cannot split {model_type(model)}'s layers over "
                                f"{group.size()} ranks: {exc}") from exc
    elif hasattr(model, "shard"):
        model.shard(group)
    elif model_type(model) == "gemma3_text":
        _shard_gemma3(model, group)
    else:
        raise ShardingError(f"no tensor-parallel layout for {model_type(model)}")
    mx.eval(model.parameters())


def pipeline_families() -> list[str]:
    """The installed mlx-lm's model modules that define a pipeline() (for the error message)."""
    from pathlib import Path

    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    return sorted(path.stem for path in folder.glob("*.py")
                  if path.stem != "pipeline" and "def pipeline(" in path.read_text(errors="replace"))


def model_type(model: Any) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", type(model).__module__.rsplit(".", 1)[-1]))


def _shard_gemma3(model: Any, group: mx.distributed.Group) -> None:
    ranks = group.size()
    for layer in model.layers:
        attention = layer.self_attn
        if attention.n_heads % ranks:
            raise ShardingError(f"{attention.n_heads} attention heads do not split over "
                                f"{ranks} ranks")
        attention.q_proj = shard_linear(attention.q_proj, "all-to-sharded", group=group)
        attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
        attention.n_heads //= ranks
        if attention.n_kv_heads % ranks == 0:
            attention.k_proj = shard_linear(attention.k_proj, "all-to-sharded", group=group)
            attention.v_proj = shard_linear(attention.v_proj, "all-to-sharded", group=group)
            attention.n_kv_heads //= ranks
        elif attention.n_kv_heads != 1:
            raise ShardingError(f"{attention.n_kv_heads} key/value heads neither split over "
                                f"{ranks} ranks nor are a single shared one")
        attention.repeats = attention.n_heads // attention.n_kv_heads
        mlp = layer.mlp
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
