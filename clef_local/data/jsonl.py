"""Labelled request files: JSONL of SystemOne requests (``clef-local data convert`` writes them, :mod:`.convert`).

One line per request: the ``/v1/systemone`` body (``model``, ``state``, ``questions``), plus optional ``id`` (a
string) and ``labels`` (``{question id: option id | true/false | level index}``: a choice's gold option, a noul's
truth, a score's level). Reading checks every line and names the line that is wrong; the request itself is
validated by the model when it runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clef_local.data.datasets import Example


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
