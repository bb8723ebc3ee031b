"""Start-up cost of a persistent prompt cache against the store's size (issue 15).

Builds, in a scratch folder, a store of SIZE GiB as a server leaves it (a data file and its index
of ~2 MiB records, the record size of a 256-token block of an 8B model) and times opening it the
way `rewind serve --cache-persist` does. The data file is sparse: opening must read only the
index, so the bytes' contents do not matter (a record is checked when it is used). Prints one
JSON line per size; `--out` writes them to a file as well.

    python benchmarks/persist_open.py --sizes 1 5 20 --out benchmarks/results/persist-open.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from rewind.cache import persist
from rewind.cache.store import ScratchStore

RECORD = 2 << 20


def build(folder: Path, size: int) -> int:
    count = size // RECORD
    entries, parent = [], None
    for i in range(count):
        key = i.to_bytes(8, "little") * 2
        entries.append(persist.Entry(key, parent, i * RECORD, RECORD, i * 2654435761, b""))
        parent = key if i % 32 else None  # chains of 32 blocks
    with open(folder / persist.DATA_NAME, "wb") as data:
        data.truncate(count * RECORD)  # sparse
    persist.write_index(folder, persist.Index(entries, {"models": {}}))
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 5, 20])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for gib in args.sizes:
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            size = int(gib * (1 << 30))
            count = build(folder, size)
            index_bytes = (folder / persist.INDEX_NAME).stat().st_size
            before = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
            started = time.perf_counter()
            store = ScratchStore(folder, size + (1 << 30), persist=True)
            seconds = time.perf_counter() - started
            stats = store.stats()
            store.close(), os.sync()
            rows.append({"store_gib": gib, "records": count, "index_bytes": index_bytes,
                         "open_seconds": round(seconds, 4),
                         "loaded_records": stats["loaded_records"],
                         "loaded_bytes": stats["loaded_bytes"],
                         "blocks_read": resource.getrusage(resource.RUSAGE_SELF).ru_inblock
                         - before})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
