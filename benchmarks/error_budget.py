"""``eval --error-budget`` on BANKING77 with the demo model: the threshold chosen on one set, checked on held-out rows.

    python benchmarks/error_budget.py                        # choose on test rows 0-799, check on rows 800-1599
    python benchmarks/error_budget.py --select-rows 300 --heldout-rows 300 --k 8

The thresholds are chosen on BANKING77 test rows 0…S−1 (``--k``-way choices: the gold intent and K−1 others,
seeded) exactly as ``clef-local eval --error-budget B`` chooses them (:func:`clef_local.quality.selective.
error_budget`: on the exact upper bound by default, and on the observed error for comparison), then applied to the
next H test rows, which they were not chosen on: the realised coverage and error there, with the error's exact
interval. Test rows only: the demo head was trained on BANKING77's training rows, where it is more often right.
Table in docs/benchmarks.md#selective-prediction.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from clef_local.data.convert import load_dataset
from clef_local.demo.default import default_model_path
from clef_local.quality.evaluate import evaluate, selective_questions
from clef_local.quality.selective import apply_thresholds, error_budget
from clef_local.quality.tables import cell, fmt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="default: the demo model")
    parser.add_argument("--select-rows", type=int, default=800, help="BANKING77 test rows to choose on (from 0)")
    parser.add_argument("--heldout-rows", type=int, default=800, help="the next test rows, to check on")
    parser.add_argument("--k", type=int, default=8, help="options per question (the gold intent + K−1)")
    parser.add_argument("--budgets", default="0.02,0.05,0.10", help="error budgets (comma-separated)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="compute dtype (default float32)")
    args = parser.parse_args(argv)
    import clef_local

    path = args.model or default_model_path()
    model = clef_local.load(path, dtype=args.dtype)
    started = time.perf_counter()
    select = load_dataset("banking77", split="test", limit=args.select_rows, k=args.k, seed=1)
    heldout = load_dataset("banking77", split="test", limit=args.heldout_rows, offset=args.select_rows, k=args.k,
                           seed=1)
    chosen_on, _ = evaluate(model, select, batch_size=args.batch_size)
    checked_on, _ = evaluate(model, heldout, batch_size=args.batch_size)
    print(f"{Path(path).name}: BANKING77 {args.k}-way, thresholds chosen on test rows 0-{len(select) - 1} "
          f"(accuracy {chosen_on.metrics['all']['accuracy']:.3f}), checked on the next {len(heldout)} (accuracy "
          f"{checked_on.metrics['all']['accuracy']:.3f}); {time.perf_counter() - started:.0f} s\n", flush=True)
    print("| budget | chosen on | threshold | coverage (chosen on) | error (chosen on) [95%] | coverage (held out) "
          "| error (held out) [95%] | within budget |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        for bound in ("upper", "point"):
            picked = error_budget(selective_questions(chosen_on.rows), budget, bound=bound)["types"]["choice"]
            if picked["threshold"] is None:
                print(f"| {budget:g} | {bound} | none | 0 | — | — | — | — |")
                continue
            held = apply_thresholds(selective_questions(checked_on.rows), {"choice": picked["threshold"]})["choice"]
            ok = held["error"] is not None and held["error"] <= budget
            print(f"| {budget:g} | {'exact upper bound' if bound == 'upper' else 'observed error'} | "
                  f"{picked['threshold']:.4f} | {fmt(picked['coverage'], '.1%')} | "
                  f"{cell(picked['error'], picked['error_interval'], '.2%')} | {fmt(held['coverage'], '.1%')} | "
                  f"{cell(held['error'], held['error_interval'], '.2%')} | {'yes' if ok else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
