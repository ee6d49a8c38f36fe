"""Labelled request files: one ``/v1/systemone`` body per line, with an optional ``id`` and ``labels``
(``{question id: option id | true/false | level}``), as ``clef-local data convert`` writes them (:mod:`.convert`);
``{"request": body, "labels": ...}`` lines are read too. eval, drift, calibrate, probe and train-head read them here.

Every line is checked and a bad one named; the request itself is validated when it runs. Image paths are relative
to the file's folder and read with it (docs/quality.md#data).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clef_local.data.datasets import Example


class DataFormatError(ValueError):
    """A JSONL line that is not a labelled request; the message names the file and line."""


def _media_file(value: Any, base: Path, where: str) -> Any:
    """The bytes of an image file named by a JSONL line (relative to ``base``); data URIs and non-strings as given
    (the model names what is wrong with them)."""
    if not isinstance(value, str) or value.startswith("data:"):
        return value
    path = base / Path(value).expanduser()
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataFormatError(f"{where}: image {value!r} cannot be read ({exc.strerror}: {path})") from None


def _read_media(obj: dict[str, Any], base: Path, where: str) -> None:
    for key in ("images", "videos"):
        if not isinstance(obj.get(key), list):
            continue
        if key == "images":
            obj[key] = [_media_file(v, base, where) for v in obj[key]]
        else:
            obj[key] = [[_media_file(f, base, where) for f in v] if isinstance(v, list) else v for v in obj[key]]


def _check_line(obj: Any, where: str, base: Path | None = None) -> Example:
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object (a SystemOne request), got {type(obj).__name__}")
    if isinstance(obj.get("request"), dict) and "questions" not in obj:
        # the wrapped form {"request": ..., "labels": ...} that train-head's --data once documented
        obj = {**obj["request"], **{k: obj[k] for k in ("id", "labels") if k in obj}}
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
    if base is not None:
        _read_media(request, base, where)
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
            examples.append(_check_line(obj, where, path.parent))
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
