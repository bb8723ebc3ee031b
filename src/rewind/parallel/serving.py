"""Setting up one rank of a sharded server: its shard of the model, its prompt cache, and the
engine its role needs (rank 0 leads, the others follow)."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from rewind.config import CacheConfig, EngineConfig
from rewind.parallel.agreed_cache import RankAgreedCache
from rewind.parallel.group import barrier
from rewind.parallel.replay import FollowerEngine, LeaderEngine
from rewind.parallel.shard import shard_model


def layout_name(group: mx.distributed.Group, layout: str) -> str:
    """This rank's place in the layout, e.g. "tensor-1-of-2": part of its cache keys."""
    return f"{layout}-{group.rank()}-of-{group.size()}"


def load_shard(name: str, group: mx.distributed.Group, layout: str) -> Any:
    """The model with this rank's shard. Rewind's loader (same tokenizer and folder handling as a
    single process), MLX's layers rather than the C forward (which would bypass the sharded
    projections) and each projection a layer of its own (sharding splits them by name), then
    mlx-lm's sharding. The fingerprint gains the layout, so one rank's
    records are never read as another's (their arrays hold other heads or other layers)."""
    from rewind.models.loader import load_model

    loaded = load_model(name, native_forward="off", fuse_projections=False)
    shard_model(loaded.model, group, layout)
    barrier(group)  # every rank loaded: the first plan's collectives will not wait on a load
    return dataclasses.replace(loaded, fingerprint=f"{loaded.fingerprint}|{layout_name(group, layout)}")


def rank_cache_config(config: CacheConfig, group: mx.distributed.Group, layout: str) -> CacheConfig:
    """A folder of its own for each rank's disk tier (ranks on one host share the default)."""
    from rewind.paths import scratch_dir

    folder = (config.cache_dir or scratch_dir()) / layout_name(group, layout)
    return dataclasses.replace(config, cache_dir=folder)


def build_rank_engine(loaded: Any, config: EngineConfig, group: mx.distributed.Group,
                      layout: str) -> tuple[Any, Any]:
    """(engine, prompt cache or None): a LeaderEngine on rank 0, a FollowerEngine elsewhere."""
    prompt_cache = None
    if config.cache.enabled:
        from rewind.cache.prompt_cache import PromptCache

        cache_config = rank_cache_config(config.cache, group, layout)
        config = dataclasses.replace(config, cache=cache_config)
        prompt_cache = RankAgreedCache(PromptCache(loaded.model, loaded.fingerprint, cache_config),
                                       group)
    role = LeaderEngine if group.rank() == 0 else FollowerEngine
    return role(loaded, config, prompt_cache, group), prompt_cache
