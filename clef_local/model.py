"""The public runtime: ``load`` a release, then ``decide`` SystemOne requests, one at a time or batched."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from clef_local.backends.base import Backend
from clef_local.errors import ApiUsageError, ReleaseError
from clef_local.formats.release import HEAD_WEIGHTS, Release, read_release
from clef_local.runtime.answers import CONFIDENCE_MODES, Confidence, build_response, softmax_rows
from clef_local.runtime.batching import device_pad_waste, split_by_length
from clef_local.runtime.encoding import REFERENCE_MAX_LENGTH, EncodedRecord, encode_request
from clef_local.runtime.head_reach import Reach, batch_reach, head_reach, record_reach
from clef_local.runtime.layout import build_layout
from clef_local.runtime.schema import DEFAULT_LIMITS, QUESTION_TYPES, Limits, request_to_record, validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer

log = logging.getLogger(__name__)

CALIBRATION_KEY = "clef_local_calibration"  # config.json: {"temperatures": {"noul"|"choice"|"score": T}, ...}


def read_temperatures(config: dict[str, Any], where: str = "config.json") -> dict[str, float]:
    """Per-type softmax temperatures written by ``clef-local calibrate`` (empty: uncalibrated)."""
    entry = config.get(CALIBRATION_KEY)
    if entry is None:
        return {}
    temps = entry.get("temperatures") if isinstance(entry, dict) else None
    if not isinstance(temps, dict) or not all(
            k in QUESTION_TYPES and isinstance(v, int | float) and 0 < v < float("inf") for k, v in temps.items()):
        raise ReleaseError(f"{where}: {CALIBRATION_KEY}.temperatures must map noul/choice/score to positive "
                           f"numbers, got {temps!r}; rerun clef-local calibrate or remove the key")
    return {k: float(v) for k, v in temps.items()}


def _checked_confidence(mode: str) -> Confidence:
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"confidence must be one of {', '.join(CONFIDENCE_MODES)}, got {mode!r}")
    return cast(Confidence, mode)


@dataclass(frozen=True)
class Prediction:
    """One request's encoded form and per-question option probabilities (model order: sorted choice ids)."""

    record: dict[str, Any]
    encoded: EncodedRecord
    probabilities: list[np.ndarray]  # one float32 vector per question, aligned with encoded.questions

    def response(self, confidence: Confidence = "jev") -> dict[str, Any]:
        return build_response(self.record, self.encoded, self.probabilities, confidence)


class ClefModel:
    """A loaded Clef release. ``decide`` takes a ``/v1/systemone`` request body and returns its response."""

    def __init__(self, release: Release, backend: Backend, tokenizer: ReleaseTokenizer, *,
                 max_length: int | None = None, confidence: Confidence = "jev",
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.release = release
        self.backend = backend
        self.tokenizer = tokenizer
        context = release.max_position_embeddings or REFERENCE_MAX_LENGTH
        # The reference's limit, lowered to the backbone's context when that is shorter.
        self.max_length = max_length or min(REFERENCE_MAX_LENGTH, context)
        self.confidence: Confidence = _checked_confidence(confidence)
        self.limits = limits
        # logits are divided by their question type's temperature before the softmax (clef-local calibrate)
        self.temperatures = read_temperatures(release.config, str(release.path / "config.json"))
        # how much padding a batch may carry on this device (clef_local.runtime.batching): tight on a CPU
        self.pad_waste = device_pad_waste(backend.device)
        # how far the head reads a record decides how far the backbone runs (clef_local.runtime.head_reach); set it
        # to Reach.WHOLE_RECORD to run every record in full (the same numbers, for comparisons)
        self.reach: Reach = head_reach(release.path / HEAD_WEIGHTS)

    @property
    def path(self) -> Path:
        return self.release.path

    def encode(self, request: Any, *, truncate_state: bool = False) -> tuple[dict[str, Any], EncodedRecord]:
        """Validate a request and encode it; raises the schema / max-tokens errors of :mod:`clef_local.errors`."""
        record = request_to_record(validate_request(request, self.limits))
        if record.get("images") or record.get("videos"):
            raise ApiUsageError("images and videos are not supported by clef-local yet; send a text or JSON state")
        encoded = encode_request(self.tokenizer, record, max_length=self.max_length, truncate_state=truncate_state)
        return record, encoded

    def predict(self, requests: Sequence[Any], *, truncate_state: bool = False, batch_size: int = 8,
                progress: Callable[[int, int], None] | None = None,
                batch_seconds: list[float] | None = None) -> list[Prediction]:
        """Probabilities for each request (in request order), run in padded batches of similar lengths.

        ``progress(done, total)`` is called after each batch; ``batch_seconds``, when given, receives each batch's
        wall time (backbone and head; validation and encoding excluded). See :meth:`predict_batches` for how
        batches are cut.
        """
        results: list[Prediction | None] = [None] * len(requests)
        done = 0
        batches = self.predict_batches(requests, truncate_state=truncate_state, batch_size=batch_size)
        began = time.perf_counter()
        for chunk, predictions in batches:
            if batch_seconds is not None:
                batch_seconds.append(time.perf_counter() - began)
            for i, prediction in zip(chunk, predictions, strict=True):
                results[i] = prediction
            done += len(chunk)
            if progress is not None:
                progress(done, len(requests))
            began = time.perf_counter()
        return [r for r in results if r is not None]

    def predict_batches(self, requests: Sequence[Any], *, truncate_state: bool = False, batch_size: int = 8
                        ) -> Iterator[tuple[list[int], list[Prediction]]]:
        """``(request indices, their predictions)`` for each batch as it finishes (for progress and timing).

        Every request is validated and encoded first (so a bad one raises before any batch runs). Batches hold up
        to ``batch_size`` requests sorted by token count, cut where padding would cost more than
        ``self.pad_waste`` times the rows' own tokens (:mod:`clef_local.runtime.batching`): on a CPU, where padding
        is pure loss, only equal lengths share one.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        encoded = [self.encode(r, truncate_state=truncate_state) for r in requests]
        chunks = split_by_length([self._backbone_positions(e[1]) for e in encoded], self.pad_waste,
                                 max_size=batch_size)

        def run() -> Iterator[tuple[list[int], list[Prediction]]]:
            for chunk in chunks:
                probs = self._probabilities([encoded[i][1] for i in chunk])
                yield chunk, [Prediction(*encoded[i], p) for i, p in zip(chunk, probs, strict=True)]

        return run()

    def _backbone_positions(self, record: EncodedRecord) -> int:
        return record_reach(record, self.reach)

    def _probabilities(self, records: list[EncodedRecord]) -> list[list[np.ndarray]]:
        layout = build_layout(records, max(len(r.input_ids) for r in records))
        started = time.perf_counter()
        reach = None if self.reach is Reach.WHOLE_RECORD else batch_reach(records, self.reach)
        logits = self.backend.logits(records, layout, self.tokenizer.pad_token_id, reach=reach)
        if self.temperatures:
            temps = [self.temperatures.get(QUESTION_TYPES[q.question_type], 1.0) for r in records for q in r.questions]
            logits = logits / np.asarray(temps, dtype=np.float32)[:, None]
        probs = softmax_rows(logits)
        log.debug("%d records, %d questions in %.1f ms", len(records), layout.num_questions,
                  1e3 * (time.perf_counter() - started))
        out: list[list[np.ndarray]] = []
        row = 0
        for record in records:
            out.append([probs[row + i, : len(q.option_ids)] for i, q in enumerate(record.questions)])
            row += len(record.questions)
        return out

    def decide(self, request: Any, *, confidence: Confidence | None = None,
               truncate_state: bool = False) -> dict[str, Any]:
        """Answer one ``/v1/systemone`` request body (a dict); floats keep full precision."""
        return self.decide_batch([request], confidence=confidence, truncate_state=truncate_state)[0]

    def decide_batch(self, requests: Sequence[Any], *, confidence: Confidence | None = None,
                     truncate_state: bool = False, batch_size: int = 8) -> list[dict[str, Any]]:
        """Answer several requests in padded batches; the same numbers as one by one (within float noise)."""
        mode = _checked_confidence(confidence or self.confidence)
        predictions = self.predict(requests, truncate_state=truncate_state, batch_size=batch_size)
        return [p.response(mode) for p in predictions]

    def describe(self) -> dict[str, Any]:
        """What ``clef-local inspect`` prints: backbone, sizes, head config, dtype, context."""
        release = self.release
        return {
            "path": str(release.path),
            "architecture": release.architecture,
            "hidden_size": release.hidden_size,
            "vision_tower": release.has_vision,
            "context": self.max_length,
            "weight_files": [f.name for f in release.weight_files],
            "weight_bytes": release.weight_bytes,
            "quantization": release.quantization,
            "head_config": release.head_config.to_json_dict(),
            "tokenizer_vocab": self.tokenizer.vocab_size,
            "confidence": self.confidence,
            "backbone_pass": self.reach.value,
            **self.backend.describe(),
            **({"loader": decision.to_json()} if (decision := self.backend.load_decision) else {}),
        }


def load(path: str | Path, *, device: str = "auto", dtype: str | None = None, backend: str = "auto",
         max_length: int | None = None, confidence: Confidence = "jev",
         limits: Limits = DEFAULT_LIMITS) -> ClefModel:
    """Load a Clef release (or variant) directory.

    ``backend`` is ``"auto"``, ``"torch"``, ``"mlx"`` or ``"onnx"`` and ``device`` ``"auto"``, ``"cpu"``, ``"cuda"``
    (``"cuda:N"``) or ``"mps"``; :mod:`clef_local.planning.choice` decides what ``"auto"`` means on this machine.
    ``dtype`` is the backbone's compute dtype (``None``: as stored, BF16 for real releases; ``"float32"`` for
    exact comparisons); the joint schema head always runs in float32. ``max_length`` defaults to the smaller of
    the reference's 16,384 and the backbone's context.
    """
    from clef_local.backends.loader import build_backend

    release = read_release(path)
    started = time.perf_counter()
    runner = build_backend(release, backend=backend, device=device, dtype=dtype)
    model = ClefModel(release, runner, ReleaseTokenizer(release.path),
                      max_length=max_length, confidence=confidence, limits=limits)
    log.info("loaded %s in %.1f s", release.path, time.perf_counter() - started)
    return model
