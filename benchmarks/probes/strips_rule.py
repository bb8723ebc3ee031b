"""Which path the GGUF products should take for a given number of activation rows, on this CPU:
the default model's head (Q8_0, 262k x 640) and its 18 layers' four products (Q5_0, Q8_0, Q4_K,
Q6_K), timed through the stored blocks, VNNI strips, AMX tiles for every type, and the measured
rule (AMX for k-quants from 16 rows, VNNI strips otherwise). Every path gives the same bits
(tests/test_quant_kernels.py); only the time differs. Best of 5, milliseconds.

    python benchmarks/probes/strips_rule.py --rows 5,8,16,33,64,128
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PATHS = ("measured rule", "AMX for all", "VNNI strips", "stored blocks")


def best_ms(call, repeats: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/strips_rule.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", default="5,8,16,24,33,64,128")
    args = parser.parse_args()

    from rewind.kernels import boundary, native
    from rewind.kernels.fast_head import fast_head
    from rewind.kernels.native_forward import native_forward
    from rewind.models.loader import load_model

    model = load_model(args.model).model
    head, forward, kernels = fast_head(model), native_forward(model), boundary.kernels()
    if head is None or forward is None or kernels is None or forward.form != "gguf":
        raise SystemExit("needs the CPU kernels and a model read from its GGUF in place")
    library = native.load_kernels()
    layer = forward.layers[len(forward.layers) // 2]
    matrices = [layer.qkv.args, layer.o.args, layer.gate_up.args, layer.down.args]
    amx = kernels.uses_amx
    print(f"kernels: {native.chosen_isa()}, AMX {'on' if amx else 'off (the AMX rows are VNNI)'}")
    print(f"model layers: {forward.stored_types}; head: {head.vocab} x {head.dim}\n")
    print("| rows | " + " | ".join(f"{p}: head / layers" for p in PATHS) + " |")
    print("| ---: |" + " ---: |" * len(PATHS))
    for rows in (int(r) for r in args.rows.split(",")):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((rows, head.dim)).astype(np.float32)
        inputs = [rng.standard_normal((rows, m.cols)).astype(np.float32) for m in matrices]
        outputs = [np.empty((rows, m.rows), np.float32) for m in matrices]

        def layers() -> None:
            for matrix, given, out in zip(matrices, inputs, outputs):
                kernels.matvec(matrix, given, out, native.kernel_threads())

        cells = []
        for path in PATHS:
            native.set_amx_rule(library, {"measured rule": "measured", "AMX for all": "all"}
                                .get(path, "none"))
            native.set_strips_above(library, {"stored blocks": 1 << 20, "measured rule":
                                              native.STRIPS_ABOVE_DEFAULT}.get(path, 4))
            cells.append(f"{best_ms(lambda: head.logits(x)):.1f} / "
                         f"{best_ms(layers) * len(forward.layers):.1f}")
        native.set_amx_rule(library, "measured")
        native.set_strips_above(library, native.STRIPS_ABOVE_DEFAULT)
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
