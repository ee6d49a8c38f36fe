"""Deciding one chunk of rows: the same code in the local job and in every Ray replica, so both write the same bytes.

Each row is encoded on its own (:meth:`ClefModel.encode`; a 4xx stays with its row), the rows that encode run
through :meth:`ClefModel.run` together, and each answer becomes one JSONL line. Batches never cross a chunk, so a
chunk's bytes do not depend on what ran before it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clef_local.batch.io import Row, RowError
from clef_local.errors import ClefError
from clef_local.runtime.answers import Confidence, below_threshold, round_floats

if TYPE_CHECKING:
    from clef_local.model import ClefModel
    from clef_local.runtime.encoding import EncodedRecord


@dataclass(frozen=True)
class ChunkSettings:
    """What changes a chunk's bytes besides the model and the rows."""

    batch_size: int = 8
    confidence: Confidence | None = None  # None: the model's
    truncate_state: bool = False
    digits: int | None = 4  # floats rounded as on the wire; None keeps full precision


@dataclass(frozen=True)
class ChunkResult:
    """One decided chunk: its answers' and errors' JSONL bytes, their counts and the time it took."""

    chunk: int
    out: bytes
    err: bytes
    rows: int
    errors: int
    seconds: float


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk after validation and tokenization: the rows that encode, and the errors of those that do not."""

    chunk: int
    rows: list[Row]
    encoded: list[tuple[Row, EncodedRecord]]
    errors: dict[int, RowError]  # row position → why it has no answer


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def row_error(exc: ClefError) -> RowError:
    return RowError(exc.status_code, exc.error_type, str(exc), exc.to_detail())


def encode_chunk(model: ClefModel, chunk: int, rows: Sequence[Row], settings: ChunkSettings) -> EncodedChunk:
    """Validate and tokenize every row; a 4xx :class:`ClefError` stays with its row, anything else propagates."""
    encoded = []
    errors: dict[int, RowError] = {}
    for row in rows:
        if row.request is None:
            errors[row.position] = row.error or RowError(422, "validation_error", "no request")
            continue
        try:
            record = model.encode(row.request, truncate_state=settings.truncate_state)
        except ClefError as exc:
            if not 400 <= exc.status_code < 500:
                raise  # a broken release or a full device is the job's problem, not the row's
            errors[row.position] = row_error(exc)
            continue
        encoded.append((row, record))
    return EncodedChunk(chunk, list(rows), encoded, errors)


def decide_encoded(model: ClefModel, encoded: EncodedChunk, settings: ChunkSettings,
                   progress: Callable[[int], None] | None = None) -> ChunkResult:
    """Run the encoded rows through the model and serialize the chunk (answers and errors in row order).

    ``progress(rows)`` is called after each batch with the number of rows it finished.
    """
    started = time.perf_counter()
    mode = settings.confidence or model.confidence
    answers: dict[int, dict[str, Any]] = {}
    records = [record for _, record in encoded.encoded]
    thresholds = model.thresholds
    for chunk, predictions in model.run(records, batch_size=settings.batch_size):
        for i, prediction in zip(chunk, predictions, strict=True):
            response = prediction.response(mode)
            if thresholds:  # the model stores confidence thresholds (calibrate --error-budget): mark what is under
                response["below_threshold"] = below_threshold(prediction.encoded, prediction.probabilities,
                                                              thresholds)
            answers[encoded.encoded[i][0].position] = response
        if progress is not None:
            progress(len(chunk))
    out, err = [], []
    for row in encoded.rows:
        if row.position in answers:
            response = answers[row.position]
            if settings.digits is not None:
                response = round_floats(response, settings.digits)
            out.append(_dumps({"id": row.id, **response}) + "\n")
        else:
            e = encoded.errors[row.position]
            err.append(_dumps({"id": row.id, "row": row.position, "status": e.status, "error_type": e.error_type,
                               "message": e.message, "detail": e.detail}) + "\n")
    if progress is not None and encoded.errors:
        progress(len(encoded.errors))
    return ChunkResult(encoded.chunk, "".join(out).encode(), "".join(err).encode(), len(encoded.rows), len(err),
                       time.perf_counter() - started)


def decide_chunk(model: ClefModel, chunk: int, rows: Sequence[Row], settings: ChunkSettings) -> ChunkResult:
    """:func:`encode_chunk` then :func:`decide_encoded` (what a Ray replica runs for each chunk)."""
    return decide_encoded(model, encode_chunk(model, chunk, rows, settings), settings)
