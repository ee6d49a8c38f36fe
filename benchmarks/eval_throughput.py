"""Throughput of ``clef-local eval`` with batching against one request at a time, on the same labelled requests.

    python benchmarks/eval_throughput.py                                  # demo model, 64 NLU++ requests, batch 8
    python benchmarks/eval_throughput.py --requests 8 --batch-size 8      # reduced (a busy 2-core CPU)

Both go through :func:`clef_local.quality.evaluate.evaluate` on one loaded model (one warm-up request first),
alternating ``--rounds`` times (the faster run of each counts); prints
one table: batch size, requests, seconds, requests/s, tokens/s, and the batched/one-at-a-time ratio.
Table in docs/benchmarks.md#drift-recalibration-eval (``eval`` throughput).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import clef_local
from clef_local.data.convert import load_dataset, parse_folds
from clef_local.demo.default import default_model_path
from clef_local.quality.evaluate import evaluate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="release (default: the demo model)")
    parser.add_argument("--requests", type=int, default=64, help="NLU++ requests (8 noul questions each)")
    parser.add_argument("--folds", default="16-19")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2,
                        help="batched and one-at-a-time runs alternate this many times; the faster of each counts "
                             "(the first run after loading is often slower on a CPU)")
    args = parser.parse_args(argv)
    examples = load_dataset("nlupp", folds=parse_folds(args.folds))[: args.requests]
    model = clef_local.load(args.model or default_model_path(), dtype=args.dtype)
    model.predict([examples[0].request])  # warm-up: first-call allocations and kernel selection
    best: dict[int, object] = {}
    for _ in range(args.rounds):
        for batch in (args.batch_size, 1):
            result, _ = evaluate(model, examples, batch_size=batch)
            if batch not in best or result.speed["requests_per_s"] > best[batch].speed["requests_per_s"]:
                best[batch] = result
    rows = [(batch, best[batch]) for batch in (args.batch_size, 1)]
    print(f"model {model.path} ({args.dtype}), {len(examples)} NLU++ requests, "
          f"{rows[0][1].questions} questions, {rows[0][1].meta['tokens']} tokens")
    print("| batch | requests | seconds | requests/s | tokens/s |\n|---|---|---|---|---|")
    for batch, r in rows:
        s = r.speed
        print(f"| {batch} | {r.requests} | {s['compute_s']:.1f} | {s['requests_per_s']:.3f} "
              f"| {s['tokens_per_s']:.0f} |")
    ratio = rows[0][1].speed["requests_per_s"] / rows[1][1].speed["requests_per_s"]
    print(f"batched (batch {args.batch_size}) / one at a time: {ratio:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
