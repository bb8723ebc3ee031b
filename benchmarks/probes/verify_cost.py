"""What verifying drafted tokens adds to a decode step, by batch size, in-process.

A speculative step feeds a drafting row [input, k drafts] and reads logits at every position.
Where a step is bound by reading the weights (one row on a CPU), the k extra positions cost
only their arithmetic, so a draft pays when the tokens it is expected to keep save more steps
than its positions cost. With more rows in the step the weights are read once for all of them
anyway and arithmetic dominates, so the same draft buys less: this bench finds where.

For each batch size R and draft length k it times the runner's forward pass over R rows whose
caches hold `--context` tokens, with one row drafting k tokens (the others one token each),
exactly as the scheduler builds the step (rewind.engine.scheduler._decode_segments), on the
model as served, and the rollback of the draft (a linear-attention layer's recurrence runs again
for the kept positions: here none is kept but the input). On MLX's layers (Qwen 3.5, Gemma 4 with
bf16 weights) a row drafts only while it decodes alone: R is 1 there. Reported: milliseconds per step, the extra over k = 0, and the accepted tokens
a draft must keep to pay for itself: extra / (step at k = 0) [each kept token saves one step].
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rewind.bench.report import Report, Table


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="registry name or folder")
    parser.add_argument("--context", type=int, default=1024, help="tokens each row holds")
    parser.add_argument("--rows", default="1,2,4", help="batch sizes (comma-separated)")
    parser.add_argument("--drafts", default="0,1,2,4,8,16", help="draft lengths k")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per point")
    parser.add_argument("--quick", action="store_true", help="tiny model, few points")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tag", default="")


def _step(runner: Any, caches: list[list[Any]], draft: int) -> float:
    """Seconds of one decode step with row 0 drafting `draft` tokens. The drafts are rolled
    back after it (as if all were rejected); each row keeps its input token, so contexts grow
    by one a step (a ring that wrapped cannot give a one-token update back)."""
    import mlx.core as mx

    from rewind.cache.rollback import roll_back
    from rewind.engine.runner import RowCaches, Segment

    segments = []
    if draft:
        segments.append(Segment(mx.array([[7] * (draft + 1)]), caches[0], logits=True,
                                logit_positions=draft + 1))
        rest = caches[1:]
    else:
        rest = caches
    if rest:
        segments.append(Segment(mx.array([[7]] * len(rest)), RowCaches(rest), logits=True))
    started = time.perf_counter()
    logits = runner.forward(segments)
    mx.eval([a for a in logits if a is not None])
    if draft:
        roll_back(caches[0], draft)
        mx.eval([layer.state for layer in caches[0]])
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from rewind.engine.runner import ModelRunner
    from rewind.models.loader import load_model

    if args.quick:
        from rewind.bench.sidebyside import quick_model_dir

        args.model, args.context, args.rows, args.drafts, args.repeats = (
            str(quick_model_dir()), 300, "1,2", "0,4", 2)
    loaded = load_model(args.model)
    runner = ModelRunner(loaded.model)
    rows_list = [int(r) for r in args.rows.split(",")]
    if runner.layer_count is None:
        if not runner.lone_rows_exact:
            raise SystemExit("verify-cost measures steps whose rows compute alone (the CPU "
                             "kernels, MLX's layers on the CPU with bf16 weights, or on CUDA "
                             "a bf16 model of attention layers); this backend or model does "
                             "not run them")
        # MLX's layers: a row drafts only while it decodes alone (rewind.engine.scheduler).
        runner.draft_alone()
        rows_list, args.rows = [1], "1"
    drafts = [int(k) for k in args.drafts.split(",")]
    prompt = [(i * 7919) % 1000 + 10 for i in range(args.context)]
    results: list[dict[str, Any]] = []
    table_rows = []
    for rows in rows_list:
        caches = []
        for _ in range(rows):
            cache = runner.new_cache()
            runner.prefill(cache, prompt, logits=False)
            caches.append(cache)
        mx.eval([[layer.state for layer in c] for c in caches])
        base = None
        for draft in drafts:
            _step(runner, caches, draft)  # warm-up
            times = [_step(runner, caches, draft) for _ in range(args.repeats)]
            ms = statistics.median(times) * 1e3
            base = ms if draft == 0 else base
            extra = None if base is None or draft == 0 else ms - base
            pays_at = None if extra is None or base is None else extra / base
            results.append({"rows": rows, "draft": draft, "step_ms": ms, "extra_ms": extra,
                            "tokens_to_pay": pays_at, "samples_ms": [t * 1e3 for t in times]})
            table_rows.append([rows, draft, f"{ms:.1f}",
                               "" if extra is None else f"{extra:+.1f}",
                               "" if extra is None else f"{extra / draft:.2f}",
                               "" if pays_at is None else f"{pays_at:.2f}"])
        del caches
        mx.clear_cache()
    stem = "verify-cost" + ("-quick" if args.quick else "") + (f"-{args.tag}" if args.tag else "")
    report = Report(
        workload="verify-cost", command="python benchmarks/probes/verify_cost.py " + " ".join(
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("model", "context", "rows", "drafts", "repeats")),
        params={"model": args.model, "context": args.context, "rows": rows_list,
                "drafts": drafts, "repeats": args.repeats},
        servers={}, fairness=["One process, one model, the runner's forward pass as the "
                              "scheduler calls it; median of the timed steps."],
        records=results, summary={},
        tables=[Table("A decode step with one row drafting k tokens (median ms)",
                      ["rows", "k", "step ms", "extra ms", "ms per drafted token",
                       "kept tokens to pay"], table_rows,
                      note="`kept tokens to pay`: the extra time over one plain step; a draft "
                           "saves one step per token kept, so it pays above this many.")])
    for path in report.write(Path(args.out), stem):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/probes/verify_cost.py",
                                     description=__doc__.splitlines()[0])
    register(parser)
    return run(parser.parse_args(argv)) or 0


if __name__ == "__main__":
    sys.exit(main())
