"""A decode batch's products on CUDA, one shape at a time: each tiling of
rewind.kernels.cuda_skinny against MLX's matmul (cuBLAS), for a Llama-3.2-1B layer's weight
shapes and its head, at 8, 16 and 32 rows. Made to run under Nsight Compute: every product is
evaluated alone between two marker kernels, so that `--report` can give each product the GPU
time of the kernels between its markers (cuBLAS may run more than one).

Also checks each tiling: the largest difference from a float32 product relative to the output's
largest magnitude, and that three rows computed alone get the bits they get among all rows.

Usage (the checks, then the same products under Nsight Compute, then the table):
  python benchmarks/probes/skinny_tilings.py --plan plan.json [--rows 8 16 32]
  ncu --clock-control none --metrics <METRICS, comma-separated> -o products \\
      python benchmarks/probes/skinny_tilings.py --plan plan.json --profiled [--rows ...]
  ncu --import products.ncu-rep --csv --page raw > ncu.csv
  python benchmarks/probes/skinny_tilings.py --report ncu.csv --plan plan.json [--json F]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from skinny_products import shapes  # noqa: E402 - the probe beside this one: the same products

SHAPES = shapes()
# (w_tiles, warps, unroll, split, stream_w), each row count taking those that `fits`
TILINGS = [(1, 8, 4, 1, 0), (1, 8, 4, 1, 1), (2, 8, 2, 1, 0), (2, 8, 4, 1, 0), (4, 8, 1, 1, 0),
           (4, 8, 2, 1, 0), (1, 16, 2, 1, 0), (1, 4, 8, 1, 0), (1, 8, 4, 2, 0), (1, 8, 4, 4, 0),
           (2, 8, 2, 2, 0), (2, 8, 2, 4, 0), (4, 8, 1, 4, 0), (4, 8, 2, 8, 0)]
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "lts__t_bytes.sum",
           "l1tex__t_sector_hit_rate.pct", "sm__warps_active.avg.pct_of_peak_sustained_active",
           "launch__grid_size", "launch__registers_per_thread")
MARKER = "rewind_probe_marker"
# Nsight Compute's units in its raw page, to nanoseconds and bytes
_UNIT_SCALES = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6,
                "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


def fits(choice: tuple, rows: int) -> bool:
    """The kernel's shared memory, and registers for the sums (w_tiles x tiles of 8 rows x 4)."""
    from rewind.kernels import cuda_skinny

    tiling = cuda_skinny.Tiling(*choice[:4], bool(choice[4]))
    return cuda_skinny.fits(tiling, rows) and tiling.w_tiles * cuda_skinny.tiles(rows) <= 16


def run(plan_path: Path, rows_list: list[int], profiled: bool) -> int:
    import mlx.core as mx

    from rewind.kernels import cuda_skinny

    if not cuda_skinny.available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    marker = mx.fast.cuda_kernel(name=MARKER, input_names=["a"], output_names=["out"],
                                 source="out[0] = a[0];")

    seed = mx.zeros((1,))
    mx.eval(seed)  # its fill kernel runs now, not between a pair of markers

    def mark() -> None:
        mx.eval(marker(inputs=[seed], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                       output_shapes=[(1,)], output_dtypes=[mx.float32])[0])

    plan = []
    for name, n, k in SHAPES:
        w = (mx.random.normal((n, k), key=mx.random.key(n + k)) * 0.02).astype(mx.bfloat16)
        for rows in rows_list:
            x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
            exact = x.astype(mx.float32) @ w.astype(mx.float32).T
            mx.eval(w, x, exact)
            scale = mx.max(mx.abs(exact)).item() if not profiled else 0.0
            choices = [None] + [t for t in TILINGS if fits(t, rows)]
            for choice in choices:
                tiling = None if choice is None else cuda_skinny.Tiling(*choice[:4],
                                                                        bool(choice[4]))

                def product(xs: mx.array) -> mx.array:
                    return xs @ w.T if tiling is None else cuda_skinny.matmul(xs, w, tiling)

                entry = {"product": name, "n": n, "k": k, "rows": rows,
                         "kernel": "mlx" if choice is None else "skinny", "tiling": choice}
                if profiled:  # nothing but the product between the markers, nothing else run
                    mark()
                    mx.eval(product(x))
                    mark()
                    continue
                out = product(x)
                alone = mx.array([rows - 1, 0, rows // 2])
                entry["off_rel"] = mx.max(mx.abs(out.astype(mx.float32) - exact)).item() / scale
                entry["rows_alone_same_bits"] = mx.array_equal(product(x[alone]),
                                                               out[alone]).item()
                plan.append(entry)
    if not profiled:
        plan_path.write_text(json.dumps(plan, indent=1) + "\n")
    return 0


def report(csv_path: Path, plan_path: Path, json_path: Path | None) -> int:
    plan = json.loads(plan_path.read_text())
    text = csv_path.read_text()
    table = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    units = next((r for r in table if not r["ID"]), {})  # --page raw's second row
    rows = [r for r in table if r.get("Kernel Name") and r["ID"].isdigit()]
    # the product's kernels sit between each pair of markers
    segments, current, inside = [], [], False
    for r in rows:
        if MARKER in r["Kernel Name"]:
            if inside:
                segments.append(current)
            current, inside = [], not inside
        elif inside:
            current.append(r)
    if len(segments) != len(plan):
        print(f"{len(segments)} marked products in the report, {len(plan)} in the plan",
              file=sys.stderr)
        return 1

    def number(r: dict, metric: str) -> float:
        """The metric in nanoseconds or bytes, whatever unit the report gave it in."""
        value = float(str(r.get(metric, "0")).replace(",", "") or 0)
        return value * _UNIT_SCALES.get(units.get(metric, ""), 1.0)

    for entry, kernels in zip(plan, segments):
        ns = sum(number(r, "gpu__time_duration.sum") for r in kernels)
        entry["gpu_us"] = ns / 1e3
        entry["weights_tb_s"] = entry["n"] * entry["k"] * 2 / ns / 1e3 if ns else None
        entry["dram_mb"] = sum(number(r, "dram__bytes_read.sum") for r in kernels) / 1e6
        entry["l2_mb"] = sum(number(r, "lts__t_bytes.sum") for r in kernels) / 1e6
        main = max(kernels, key=lambda r: number(r, "gpu__time_duration.sum"))
        entry["main_kernel"] = main["Kernel Name"][:60]
        entry["l1_hit_pct"] = number(main, "l1tex__t_sector_hit_rate.pct")
        entry["warps_active_pct"] = number(
            main, "sm__warps_active.avg.pct_of_peak_sustained_active")
        entry["grid"] = number(main, "launch__grid_size")
        entry["registers"] = number(main, "launch__registers_per_thread")
        entry["kernels"] = len(kernels)
    print("| product | rows | kernel (w_tiles, warps, unroll, split, stream_w) | GPU us | "
          "weights TB/s | DRAM MB | L2 MB | L1 hit % | warps active % | grid | regs | "
          "off (rel.) | rows alone same bits |")
    print("| --- | ---: | --- |" + " ---: |" * 9 + " --- |")
    for e in plan:
        label = "MLX (cuBLAS)" if e["tiling"] is None else str(tuple(e["tiling"]))
        print(f"| {e['product']} | {e['rows']} | {label} | {e['gpu_us']:.1f} | "
              f"{e['weights_tb_s']:.2f} | {e['dram_mb']:.1f} | {e['l2_mb']:.1f} | "
              f"{e['l1_hit_pct']:.0f} | {e['warps_active_pct']:.0f} | {e['grid']:.0f} | "
              f"{e['registers']:.0f} | {e['off_rel']:.1e} | {e['rows_alone_same_bits']} |")
    print()
    print("Best tiling a product and row count (GPU time), against cuBLAS:")
    print()
    print("| product | rows | cuBLAS us | base tiling us | best tiling | best us |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for name, _, _ in SHAPES:
        for count in sorted({e["rows"] for e in plan}):
            group = [e for e in plan if e["product"] == name and e["rows"] == count]
            if not group:
                continue
            mlx = next(e for e in group if e["tiling"] is None)
            ours = [e for e in group if e["tiling"] is not None]
            base = next(e for e in ours if tuple(e["tiling"]) == TILINGS[0])
            best = min(ours, key=lambda e: e["gpu_us"])
            print(f"| {name} | {count} | {mlx['gpu_us']:.1f} | {base['gpu_us']:.1f} | "
                  f"{tuple(best['tiling'])} | {best['gpu_us']:.1f} |")
    if json_path:
        json_path.write_text(json.dumps(plan, indent=1) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog=f"python benchmarks/probes/{Path(__file__).name}",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, required=True,
                        help="where the products' order and checks go (read by --report)")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32],
                        help="2 to cuda_skinny.MAX_ROWS (32; 64 when the first results were "
                             "measured)")
    parser.add_argument("--report", type=Path, default=None,
                        help="Nsight Compute's CSV (--csv --page raw) of a run with --plan")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profiled", action="store_true",
                        help="the run under Nsight Compute: the same products in the same "
                             "order, each alone between its markers, no checks (the plan "
                             "comes from a run without this)")
    args = parser.parse_args()
    if args.report:
        return report(args.report, args.plan, args.json)
    return run(args.plan, args.rows, args.profiled)


if __name__ == "__main__":
    raise SystemExit(main())
