"""A batch job's files: rows read from JSONL, CSV or Parquet, answers written in one of the three.

Each :class:`Row` carries its position, its id and its request or the reason it has none; tables need ``--schema``
(the questions are the columns) and go through pyarrow. The formats, row by row: docs/batch.md#on-one-machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.errors import BatchError

EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
DEFAULT_MODEL_NAME = "clef-local"  # the ``model`` of a table row's request (and of a JSONL line without one)
_TABLE_BATCH = 4096  # rows per pyarrow record batch while reading


def file_format(path: Path, flag: str) -> str:
    """``jsonl``, ``csv`` or ``parquet`` from the file's extension; :class:`BatchError` names the ones known."""
    kind = EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        known = ", ".join(EXTENSIONS)
        raise BatchError(f"{flag} {path}: unknown extension {path.suffix!r}; use one of {known}")
    return kind


def pyarrow_modules() -> tuple[Any, Any, Any]:
    """``(pyarrow, pyarrow.csv, pyarrow.parquet)``, or a :class:`BatchError` that says which extra installs them."""
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.parquet
    except ModuleNotFoundError:
        raise BatchError("CSV and Parquet files need pyarrow: pip install 'clef-local[batch]'") from None
    return pyarrow, pyarrow.csv, pyarrow.parquet


@dataclass(frozen=True)
class RowError:
    """Why a row got no answer: the HTTP status and ``error_type`` the server would send, and its message."""

    status: int
    error_type: str
    message: str
    detail: Any = None


@dataclass(frozen=True)
class Row:
    """One input row: ``request`` is the body to decide, or None with ``error`` saying why there is none."""

    position: int
    id: Any
    request: dict[str, Any] | None
    error: RowError | None = None


@dataclass(frozen=True)
class InputSpec:
    """Where the requests come from: the file, its format, and for tables the columns and the shared questions."""

    path: Path
    format: str
    questions: dict[str, Any] | None = None
    state_column: str = "state"
    id_column: str | None = None  # None: the column "id" when the table has one, else row numbers


def read_schema(path: Path) -> dict[str, Any]:
    """The questions object of ``--schema``: a file holding ``{"q1": {...}, ...}`` or ``{"questions": {...}}``."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BatchError(f"--schema {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(value, dict) and isinstance(value.get("questions"), dict):
        value = value["questions"]
    if not isinstance(value, dict) or not value:
        raise BatchError(f"--schema {path}: expected the questions object ({{\"q1\": {{\"type\": \"noul\", ...}}}}) "
                         "or a request body with \"questions\"")
    return value


def json_id(value: Any) -> Any:
    """An id as it goes into the output: JSON scalars unchanged, anything else (a Parquet date...) as text."""
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _jsonl_row(line: str, number: int, questions: dict[str, Any] | None) -> Row:
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except ValueError as exc:
        message = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        return Row(number, number, None, RowError(422, "validation_error", f"line {number}: not valid JSON "
                                                  f"({message})"))
    if not isinstance(obj, dict):
        return Row(number, number, None, RowError(422, "validation_error", f"line {number}: expected a JSON "
                                                  f"object (a /v1/systemone request body), got {type(obj).__name__}"))
    row_id = json_id(obj.pop("id", number))
    if questions is not None:
        if "questions" in obj:
            return Row(number, row_id, None, RowError(422, "validation_error", f"line {number}: the line has its "
                                                      "own \"questions\" and --schema was given; use one or the "
                                                      "other"))
        obj["questions"] = questions
    obj.setdefault("model", DEFAULT_MODEL_NAME)
    return Row(number, row_id, obj)


def _jsonl_rows(spec: InputSpec) -> Iterator[Row]:
    with spec.path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield _jsonl_row(line, number, spec.questions)


def _table_columns(spec: InputSpec, names: Sequence[str]) -> tuple[str, str | None]:
    if spec.state_column not in names:
        raise BatchError(f"--in {spec.path}: no column {spec.state_column!r} for the state; its columns are "
                         f"{', '.join(names)} (pass --state-column NAME)")
    if spec.id_column is not None and spec.id_column not in names:
        raise BatchError(f"--in {spec.path}: no id column {spec.id_column!r}; its columns are {', '.join(names)}")
    id_column = spec.id_column or ("id" if "id" in names else None)
    return spec.state_column, id_column


def _table_batches(spec: InputSpec) -> Iterator[list[dict[str, Any]]]:
    pa, pacsv, pq = pyarrow_modules()
    try:
        if spec.format == "parquet":
            file = pq.ParquetFile(spec.path)
            state, id_column = _table_columns(spec, file.schema_arrow.names)
            columns = [state] + ([id_column] if id_column else [])
            for batch in file.iter_batches(batch_size=_TABLE_BATCH, columns=columns):
                yield batch.to_pylist()
            return
        names = pacsv.open_csv(spec.path).schema.names
        state, id_column = _table_columns(spec, names)
        columns = [state] + ([id_column] if id_column else [])
        # every cell as text, as written: a column of digits must not turn into numbers halfway through the file
        convert = pacsv.ConvertOptions(column_types={name: pa.string() for name in columns}, include_columns=columns,
                                       strings_can_be_null=False, quoted_strings_can_be_null=False)
        for batch in pacsv.open_csv(spec.path, convert_options=convert):
            yield batch.to_pylist()
    except pa.ArrowException as exc:
        raise BatchError(f"--in {spec.path}: cannot read it as {spec.format.upper()} ({exc})") from None


def _table_rows(spec: InputSpec) -> Iterator[Row]:
    if spec.questions is None:
        raise BatchError(f"--in {spec.path}: a {spec.format.upper()} input needs --schema FILE (the questions every "
                         "row is asked)")
    position = 0
    for batch in _table_batches(spec):
        for values in batch:
            position += 1
            id_column = spec.id_column or ("id" if "id" in values else None)
            row_id = json_id(values[id_column]) if id_column else position
            request = {"model": DEFAULT_MODEL_NAME, "state": values[spec.state_column], "questions": spec.questions}
            yield Row(position, row_id, request)


def iter_rows(spec: InputSpec) -> Iterator[Row]:
    """The input's rows in file order (blank JSONL lines skipped; their line numbers still count)."""
    return _jsonl_rows(spec) if spec.format == "jsonl" else _table_rows(spec)


def count_rows(spec: InputSpec) -> int:
    """How many rows :func:`iter_rows` yields, for the progress bar (Parquet: from the footer)."""
    if spec.format == "jsonl":
        with spec.path.open(encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    if spec.format == "parquet":
        _, _, pq = pyarrow_modules()
        return int(pq.ParquetFile(spec.path).metadata.num_rows)
    return sum(len(batch) for batch in _table_batches(spec))


# ---------------------------------------------------------------- output


def concatenate(parts: Sequence[Path], out: Path) -> None:
    """Write the parts' bytes one after the other into ``out`` (JSONL output, the errors file)."""
    with out.open("wb") as sink:
        for part in parts:
            sink.write(part.read_bytes())


def _question_fields(pa: Any, qid: str, question: dict[str, Any], struct: bool, marked: bool) -> list[Any]:
    kind = question.get("type")
    mark = [pa.field(f"{qid}.below_threshold", pa.bool_())] if marked else []
    if kind == "noul":
        return [pa.field(qid, pa.float64()), *mark]
    options = ([str(k) for k in question.get("criteria") or {}] if kind == "choice"
               else [str(i) for i in range(len(question.get("criteria") or []))])
    decision = pa.string() if kind == "choice" else pa.float64()
    probabilities = pa.struct([pa.field(o, pa.float64()) for o in options]) if struct else pa.string()
    return [pa.field(qid, decision), pa.field(f"{qid}.confidence", pa.float64()),
            pa.field(f"{qid}.probabilities", probabilities), *mark]


def _table_row(line: dict[str, Any], questions: dict[str, Any], struct: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"id": line["id"]}
    marked = line.get("below_threshold")
    for qid in questions:
        if marked is not None:
            out[f"{qid}.below_threshold"] = qid in marked
        answer = line["answers"][qid]
        kind = answer["type"]
        out[qid] = answer[kind]
        if kind != "noul":
            out[f"{qid}.confidence"] = answer["confidence"]
            probs = answer["probabilities"]
            out[f"{qid}.probabilities"] = probs if struct else json.dumps(probs, ensure_ascii=False,
                                                                           separators=(",", ":"))
    return out


def write_table(parts: Sequence[Path], out: Path, fmt: str, questions: dict[str, Any]) -> None:
    """The answered rows of JSONL ``parts`` as a CSV or Parquet table (one column per question's field, and
    ``q.below_threshold`` when the model stores confidence thresholds: docs/batch.md#on-one-machine).

    Ids are integers when every id is one (row numbers, integer id columns), text otherwise.
    """
    pa, pacsv, pq = pyarrow_modules()
    lines = [[json.loads(text) for text in part.read_text(encoding="utf-8").splitlines()] for part in parts]
    integer_ids = all(isinstance(line["id"], int) and not isinstance(line["id"], bool)
                      for chunk in lines for line in chunk)
    struct = fmt == "parquet"
    marked = any("below_threshold" in line for chunk in lines for line in chunk)
    fields = [pa.field("id", pa.int64() if integer_ids else pa.string())]
    for qid, question in questions.items():
        fields += _question_fields(pa, qid, question, struct, marked)
    schema = pa.schema(fields)

    def table(chunk: list[dict[str, Any]]) -> Any:
        rows = [_table_row(line, questions, struct) for line in chunk]
        if not integer_ids:
            for row in rows:
                row["id"] = None if row["id"] is None else str(row["id"])
        return pa.Table.from_pylist(rows, schema=schema)

    with (pq.ParquetWriter(out, schema) if fmt == "parquet" else pacsv.CSVWriter(out, schema)) as writer:
        for chunk in lines:
            if chunk:
                writer.write_table(table(chunk))
        if not any(lines):  # no row answered: still the columns (a CSV header, a Parquet schema)
            writer.write_table(schema.empty_table())
