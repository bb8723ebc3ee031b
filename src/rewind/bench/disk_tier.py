"""disk-tier: write and restore speed of the scratch-file store on Gemma 3 270M-sized records.

One conversation of B blocks is checkpointed the way the prompt cache does it: per 256-token
block a K/V delta record of the 3 full-attention layers and a window record of the 15
sliding-window layers (512 positions), both chained. Measured: the time put() holds the caller
(the engine thread) and the writer's end-to-end throughput; then a restore of the whole chain
(every K/V delta plus the last window), warm (page cache) and cold (the file's pages dropped
with posix_fadvise), in tokens per second; and encode/decode speed without the disk.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx

from rewind.bench.report import Report, Table, fmt_spread, spread
from rewind.bench.sidebyside import command_line
from rewind.cache.serialize import Record, decode_record, encode_record
from rewind.cache.store import ScratchStore
from rewind.paths import scratch_dir

NAME = "disk-tier"
BLOCK_TOKENS = 256
# Gemma 3 270M: 18 layers, every 6th full attention; 1 KV head of 256; 512-token window.
FULL_LAYERS, SLIDING_LAYERS, KV_HEADS, HEAD_DIM, WINDOW = 3, 15, 1, 256, 512
POOL = 4  # distinct record contents, reused under different keys (bounds the bench's RAM)
MIB = 1 << 20


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=32, help="256-token blocks (32 = 8k tokens)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--queue", type=int, default=64, help="writer queue size")
    parser.add_argument("--folder", type=Path, default=None, help="default: the scratch folder")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="4 blocks, 1 repeat (smoke run)")


def block_records(dtype: mx.Dtype, seed: int) -> tuple[Record, Record]:
    """One block's K/V delta record and window record, random contents."""

    def arrays(layers: int, positions: int, salt: int) -> dict[str, mx.array]:
        shape = (1, KV_HEADS, positions, HEAD_DIM)
        out = {}
        for index in range(2 * layers):
            key = mx.random.key(seed * 1000 + salt + index)
            out[f"{index // 2}.{'keys' if index % 2 == 0 else 'values'}"] = (
                mx.random.normal(shape, key=key).astype(dtype)
            )
        return out

    kv, window = arrays(FULL_LAYERS, BLOCK_TOKENS, 0), arrays(SLIDING_LAYERS, WINDOW, 500)
    mx.eval(list(kv.values()) + list(window.values()))
    return Record(kv, {"kind": "kv"}), Record(window, {"kind": "window"})


def one_round(args: argparse.Namespace, folder: Path, pool: list[tuple[Record, Record]]) -> dict:
    kv_bytes, window_bytes = pool[0][0].nbytes, pool[0][1].nbytes
    total = args.blocks * (kv_bytes + window_bytes)
    store = ScratchStore(folder, budget_bytes=2 * total + (64 << 20), queue_size=args.queue)
    if not store.enabled:
        raise SystemExit(f"store disabled: {store.disabled_reason}")
    try:
        put_seconds: list[float] = []
        start = time.perf_counter()
        for block in range(args.blocks):
            kv, window = pool[block % POOL]
            parent = ("kv", block - 1) if block else None
            for key, parent_key, record in (
                (("kv", block), parent, kv),
                (("window", block), ("kv", block), window),
            ):
                before = time.perf_counter()
                assert store.put(key, parent_key, record)
                put_seconds.append(time.perf_counter() - before)
        store.flush()
        write_seconds = time.perf_counter() - start
        written = store.stats()["bytes_written"]

        def restore() -> float:
            before = time.perf_counter()
            records = [store.get(("kv", block)) for block in range(args.blocks)]
            records.append(store.get(("window", args.blocks - 1)))
            if any(record is None for record in records):
                raise SystemExit("a record did not come back")
            return time.perf_counter() - before

        warm = restore()
        cold_dropped = store.drop_page_cache()
        cold = restore()
        stats = store.stats()
    finally:
        store.close()
    restored_bytes = args.blocks * kv_bytes + window_bytes
    tokens = args.blocks * BLOCK_TOKENS
    return {
        "written_bytes": written,
        "write_seconds": write_seconds,
        "write_mib_s": written / MIB / write_seconds,
        "put_ms_median": statistics.median(put_seconds) * 1e3,
        "put_ms_max": max(put_seconds) * 1e3,
        "put_seconds_total": sum(put_seconds),
        "restore_bytes": restored_bytes,
        "restore_warm_seconds": warm,
        "restore_warm_tok_s": tokens / warm,
        "restore_warm_mib_s": restored_bytes / MIB / warm,
        "restore_cold_seconds": cold,
        "restore_cold_tok_s": tokens / cold,
        "restore_cold_mib_s": restored_bytes / MIB / cold,
        "cold_pages_dropped": cold_dropped,
        "corrupt": stats["corrupt"],
        "write_errors": stats["write_errors"],
    }


def codec_speed(record: Record) -> tuple[float, float]:
    """MiB/s of encode_record and decode_record alone (best of 3)."""
    encode_times, decode_times = [], []
    for _ in range(3):
        before = time.perf_counter()
        blob = encode_record(record)
        encode_times.append(time.perf_counter() - before)
        before = time.perf_counter()
        back = decode_record(blob)
        mx.eval(list(back.arrays.values()))
        decode_times.append(time.perf_counter() - before)
    size = len(blob) / MIB
    return size / min(encode_times), size / min(decode_times)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.blocks, args.repeats = 4, 1
    dtype = getattr(mx, args.dtype)
    folder = args.folder or scratch_dir()
    pool = [block_records(dtype, seed) for seed in range(POOL)]
    rounds = [one_round(args, folder, pool) for _ in range(args.repeats)]
    encode_mib_s, decode_mib_s = codec_speed(pool[0][1])

    def col(name: str) -> dict:
        return spread([r[name] for r in rounds])

    tokens = args.blocks * BLOCK_TOKENS
    table = Table(
        title=f"Scratch store, {tokens} tokens ({args.blocks} blocks), {args.dtype} records",
        headers=["measure", "median (min-max)"],
        rows=[
            ["bytes written per round (MiB)", f"{rounds[0]['written_bytes'] / MIB:.1f}"],
            ["write throughput, put to flushed (MiB/s)", fmt_spread(col("write_mib_s"), 0)],
            ["caller time per put (ms), median", fmt_spread(col("put_ms_median"), 3)],
            ["caller time per put (ms), worst", fmt_spread(col("put_ms_max"), 2)],
            ["restore bytes (MiB): every K/V delta + last window",
             f"{rounds[0]['restore_bytes'] / MIB:.1f}"],
            ["restore, warm page cache (tokens/s)", fmt_spread(col("restore_warm_tok_s"), 0)],
            ["restore, warm (MiB/s)", fmt_spread(col("restore_warm_mib_s"), 0)],
            ["restore, cold: pages dropped (tokens/s)", fmt_spread(col("restore_cold_tok_s"), 0)],
            ["restore, cold (MiB/s)", fmt_spread(col("restore_cold_mib_s"), 0)],
            ["encode_record alone (MiB/s)", f"{encode_mib_s:.0f}"],
            ["decode_record alone (MiB/s)", f"{decode_mib_s:.0f}"],
        ],
    )
    report = Report(
        workload=NAME,
        command=command_line(),
        params={"blocks": args.blocks, "dtype": args.dtype, "repeats": args.repeats,
                "queue": args.queue, "folder": str(folder)},
        servers={},
        fairness=["no model runs: records have Gemma 3 270M's shapes and random contents"],
        records=rounds,
        summary={
            "restore_warm_tok_s": col("restore_warm_tok_s")["median"],
            "restore_cold_tok_s": col("restore_cold_tok_s")["median"],
            "write_mib_s": col("write_mib_s")["median"],
            "put_ms_median": col("put_ms_median")["median"],
            "encode_mib_s": encode_mib_s,
            "decode_mib_s": decode_mib_s,
        },
        tables=[table],
        notes=[
            "Restore reads with pread, verifies xxh3-128 checksums and decodes into MLX arrays; "
            "rebuilding live caches from the records is the prompt cache's part, not counted here.",
            "Cold: the store fsyncs and posix_fadvise(DONTNEED)s its file; on a virtual disk the "
            "host may still cache it.",
            "Caller time per put is what the engine thread pays (budgeting and queueing); the "
            "writer thread serializes and writes. The worst case includes waits on a full queue.",
        ],
    )
    stem = f"{NAME}-quick" if args.quick else f"{NAME}-{args.dtype}"
    for path in report.write(args.out, stem):
        print(path)
    print(table.markdown())
    return 0
