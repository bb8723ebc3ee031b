"""Sharded serving: one model over the processes of an `mlx.launch` group (mx.distributed).

Rank 0 serves HTTP and runs the scheduler; every rank holds one shard of the model and of its
caches, and runs the same forward calls. Rooms: `group` (the collectives used here), `shard`
(tensor / pipeline layouts, through mlx-lm's where it has them), `plans` (what rank 0 sends
before each engine step), `replay` (the leader and follower engines) and `agreed_cache` (a
prompt cache that restores only at a point every rank holds).
"""
