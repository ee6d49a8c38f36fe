"""``clef-local data convert``: BANKING77 / NLU++ (packaged with clef-local) as labelled request JSONL.

    clef-local data convert --dataset banking77 --split test --limit 500 --out b77.jsonl          # 77-way
    clef-local data convert --dataset banking77 --split test --k 8 --seed 0 --out b77-8way.jsonl
    clef-local data convert --dataset nlupp --folds 16-19 --out nlupp.jsonl                       # noul per intent
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clef_local.data.datasets import Example, banking77_examples, nlupp_examples
from clef_local.data.jsonl import write_jsonl


def parse_folds(text: str) -> list[int]:
    """``"16-19"`` → [16, 17, 18, 19]; ``"0,3,5-6"`` → [0, 3, 5, 6]; folds are 0–19."""
    folds: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            folds.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"folds must look like 16-19 or 0,3,5-6, got {text!r}") from None
    bad = [f for f in folds if not 0 <= f <= 19]
    if bad or not folds:
        raise ValueError(f"NLU++ banking folds are 0–19, got {text!r}")
    return folds


def load_dataset(dataset: str, *, split: str = "test", folds: Sequence[int] = range(16, 20),
                 limit: int | None = None, k: int | None = None, seed: int = 0, offset: int = 0,
                 per_request: int = 8) -> list[Example]:
    """BANKING77 rows (``offset``…``offset+limit``, 77-way or ``k``-way) or NLU++ folds (``limit`` rows, noul
    questions per ontology intent, ``per_request`` per request) as labelled examples."""
    if dataset == "banking77":
        stop = None if limit is None else offset + limit
        examples = banking77_examples(split, options=k or 77, limit=stop, seed=seed)
        return examples[offset:]
    if dataset == "nlupp":
        examples = nlupp_examples(folds, per_request=per_request, seed=seed)
        if limit is None and not offset:
            return examples
        # limit counts NLU++ *rows* (utterances); each row spans several requests with the same id prefix
        rows = sorted({e.id.rsplit("-", 1)[0] for e in examples}, key=lambda s: int(s.split("-")[1]))
        keep = set(rows[offset: None if limit is None else offset + limit])
        return [e for e in examples if e.id.rsplit("-", 1)[0] in keep]
    raise ValueError(f"dataset must be banking77 or nlupp, got {dataset!r}")


def main(argv: list[str] | None = None) -> int:
    """``clef-local data convert``: write BANKING77 or NLU++ as labelled JSONL."""
    parser = argparse.ArgumentParser(prog="clef-local data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    convert = sub.add_parser("convert", help="write BANKING77 or NLU++ as labelled JSONL")
    convert.add_argument("--dataset", choices=["banking77", "nlupp"], required=True)
    convert.add_argument("--split", choices=["train", "test"], default="test", help="BANKING77 split (default test)")
    convert.add_argument("--folds", default="16-19", help="NLU++ banking folds, e.g. 16-19 or 0,3 (default 16-19)")
    convert.add_argument("--limit", type=int, help="first N rows (BANKING77) or utterances (NLU++)")
    convert.add_argument("--offset", type=int, default=0, help="skip the first N rows/utterances (default 0)")
    convert.add_argument("--k", type=int, help="BANKING77: k-way questions (gold + k−1 random intents; default 77)")
    convert.add_argument("--per-request", type=int, default=8, help="NLU++: noul questions per request (default 8)")
    convert.add_argument("--seed", type=int, default=0, help="seed for k-way options / NLU++ grouping (default 0)")
    convert.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    args = parser.parse_args(argv)
    if args.k is not None and not 2 <= args.k <= 77:
        parser.error(f"--k must be 2–77, got {args.k}")
    try:
        examples = load_dataset(args.dataset, split=args.split, folds=parse_folds(args.folds), limit=args.limit,
                                k=args.k, seed=args.seed, offset=args.offset, per_request=args.per_request)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    count = write_jsonl(examples, args.out)
    questions = sum(len(e.request["questions"]) for e in examples)
    print(f"wrote {count} requests ({questions} questions) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
