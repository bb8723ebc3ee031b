"""The few collectives sharded serving needs, on the CPU stream (the control path: small
integers and bytes, never activations)."""

from __future__ import annotations

import mlx.core as mx


def world() -> mx.distributed.Group | None:
    """The group `mlx.launch` started this process in; None when it runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def broadcast_bytes(group: mx.distributed.Group, payload: bytes | None) -> bytes:
    """Rank 0's `payload` on every rank (others pass None). MLX has no broadcast: a sum where
    every other rank adds zeros is one (its length first, so the others can size the buffer)."""
    mine = payload if group.rank() == 0 else b""
    assert mine is not None, "rank 0 must send a payload"
    length = mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int64), group=group,
                                    stream=mx.cpu)
    size = int(length.item())
    if size == 0:
        return b""
    data = (mx.array(memoryview(mine), dtype=mx.uint8) if group.rank() == 0
            else mx.zeros((size,), dtype=mx.uint8))
    summed = mx.distributed.all_sum(data, group=group, stream=mx.cpu)
    mx.eval(summed)
    return bytes(memoryview(summed))


def gather_ints(group: mx.distributed.Group, value: int) -> list[int]:
    """Every rank's `value`, in rank order, on every rank."""
    gathered = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group,
                                         stream=mx.cpu)
    return [int(v) for v in gathered.tolist()]


def barrier(group: mx.distributed.Group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
