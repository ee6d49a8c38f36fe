"""Labelled request files: JSONL of SystemOne requests, and ``clef-local data convert`` from BANKING77 / NLU++.

One line per request: the ``/v1/systemone`` body (``model``, ``state``, ``questions``), plus optional ``id`` (a
string) and ``labels`` (``{question id: option id | true/false | level index}``: a choice's gold option, a noul's
truth, a score's level). Reading checks every line and names the line that is wrong; the request itself is
validated by the model when it runs.

    clef-local data convert --dataset banking77 --split test --limit 500 --out b77.jsonl          # 77-way
    clef-local data convert --dataset banking77 --split test --k 8 --seed 0 --out b77-8way.jsonl
    clef-local data convert --dataset nlupp --folds 16-19 --out nlupp.jsonl                       # noul per intent
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from clef_local.data.datasets import Example, banking77_examples, nlupp_examples


class DataFormatError(ValueError):
    """A JSONL line that is not a labelled request; the message names the file and line."""


def _check_line(obj: Any, where: str) -> Example:
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object (a SystemOne request), got {type(obj).__name__}")
    questions = obj.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise DataFormatError(f"{where}: \"questions\" must be a non-empty object of question id → question")
    if "state" not in obj:
        raise DataFormatError(f"{where}: missing \"state\" (the text or JSON the questions are about)")
    labels = obj.get("labels") or {}
    if not isinstance(labels, dict):
        raise DataFormatError(f"{where}: \"labels\" must be an object {{question id: gold answer}}, got "
                              f"{type(labels).__name__}")
    for qid, label in labels.items():
        if qid not in questions:
            raise DataFormatError(f"{where}: label for {qid!r}, which is not one of the questions "
                                  f"{sorted(questions)[:5]}")
        if not isinstance(label, str | bool | int):
            raise DataFormatError(f"{where}: label {qid!r} must be an option id, true/false or a level index, "
                                  f"got {label!r}")
    request = {k: v for k, v in obj.items() if k not in ("id", "labels")}
    request.setdefault("model", "clef-local")
    return Example(str(obj.get("id", where)), request, dict(labels))


def read_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """Labelled requests from a JSONL file (blank lines skipped); :class:`DataFormatError` names a bad line."""
    path = Path(path)
    examples: list[Example] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            examples.append(_check_line(obj, where))
    return examples


def example_to_json(example: Example) -> dict[str, Any]:
    """One JSONL line's object: ``id``, the request's fields, ``labels`` (omitted when empty)."""
    line: dict[str, Any] = {"id": example.id, **example.request}
    if example.labels:
        line["labels"] = example.labels
    return line


def write_jsonl(examples: Iterable[Example], path: str | Path) -> int:
    """Write examples as JSONL (UTF-8, one compact object per line); returns the number written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example_to_json(example), ensure_ascii=False, separators=(",", ":")) + "\n")
            count += 1
    return count


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
