"""Input files for the batch tests: the same requests as JSONL, CSV and Parquet, plus rows the server refuses."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Does this need an answer today?"},
    "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None, "other": "Anything else"}},
    "severity": {"type": "score", "criteria": ["low", "medium", "high"]},
}
WORDS = ("card", "charged", "twice", "transfer", "late", "refund", "please", "now", "app", "crashed")


def states(n: int) -> list[str]:
    """``n`` short states of a few different lengths (so batches of equal lengths form)."""
    return [f"ticket {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(i % 5 + 1)) for i in range(n)]


def write_jsonl(path: Path, n: int, *, bad: bool = True) -> list[Any]:
    """``n`` requests (every third without an id: its line number stands in) and, with ``bad``, three rows the
    server refuses: a line that is not JSON, an unknown question type, a choice with one option. Returns the ids
    in file order, refused rows included."""
    ids: list[Any] = []
    lines = []
    for i, state in enumerate(states(n)):
        request: dict[str, Any] = {"model": "clef-flash", "state": state, "questions": SCHEMA}
        if i % 3:
            request = {"id": f"t-{i}", **request}
        lines.append(json.dumps(request))
        ids.append(request.get("id", len(lines)))
        if bad and i == n // 2:
            lines.append("{not json")
            ids.append(len(lines))
            lines.append(json.dumps({"id": "bad-type", "state": "x", "questions": {"q": {"type": "maybe"}}}))
            ids.append("bad-type")
            lines.append("")  # a blank line is skipped but counts as a line
            lines.append(json.dumps({"id": "one-option", "state": "x",
                                     "questions": {"q": {"type": "choice", "criteria": {"only": None}}}}))
            ids.append("one-option")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ids


def write_table(path: Path, n: int) -> list[str]:
    """``n`` states as CSV or Parquet (by extension) with columns ``ticket`` (id) and ``text``; returns the ids."""
    rows = [{"ticket": f"k{i:03d}", "text": state, "other": i} for i, state in enumerate(states(n))]
    if path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["ticket", "text", "other"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return [r["ticket"] for r in rows]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
