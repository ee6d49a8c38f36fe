"""From option logits to SystemOne answers (docs/format.md §5): a float32 softmax per question, Jev's confidence by
default (``confidence="reference"``: the reference's peak probability), full precision here; :func:`round_floats`
rounds for the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from clef_local.runtime.encoding import EncodedRecord
from clef_local.runtime.schema import QUESTION_TYPES, Question

Confidence = Literal["jev", "reference"]
CONFIDENCE_MODES: tuple[str, ...] = ("jev", "reference")


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    """Row-wise float32 softmax; ``-inf`` entries (padding) get probability 0."""
    logits = logits.astype(np.float32, copy=False)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def choice_confidence(probs: Sequence[float], mode: Confidence = "jev") -> float:
    """Jev: ``clip((max p − 1/n) / (1 − 1/n), 0, 1)``; reference: ``max p``."""
    peak = max(probs)
    if mode == "reference":
        return peak
    n = len(probs)
    return min(1.0, max(0.0, (peak - 1.0 / n) / (1.0 - 1.0 / n)))


def score_confidence(probs: Sequence[float], mode: Confidence = "jev") -> float:
    """Jev: ``max(0, 1 − Σ p_i |i − mode| / (Σ_i |i − (n−1)/2| / n))``; reference: ``max p``."""
    peak = max(probs)
    if mode == "reference":
        return peak
    n = len(probs)
    top = probs.index(peak)
    spread = sum(p * abs(i - top) for i, p in enumerate(probs))
    uniform_spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1.0 - spread / uniform_spread)


def build_answer(question: Question, option_ids: Sequence[str], probs: Sequence[float],
                 confidence: Confidence = "jev") -> dict[str, Any]:
    """One question's answer from its probabilities (``option_ids``/``probs`` in model order)."""
    p = dict(zip(option_ids, (float(x) for x in probs), strict=True))
    kind, criteria = question.type, question.criteria or {}
    if kind == "noul":
        return {"type": "noul", "noul": p["true"]}
    if kind == "choice":
        order = [str(label) for label in criteria]  # request key order
        ordered = [p[label] for label in order]
        choice = order[ordered.index(max(ordered))]  # ties: first in request order
        return {"type": "choice", "choice": choice, "confidence": choice_confidence(ordered, confidence),
                "probabilities": dict(zip(order, ordered, strict=True))}
    levels = [str(i) for i in range(len(criteria))]
    ordered = [p[level] for level in levels]
    return {
        "type": "score",
        "score": sum(i * x for i, x in enumerate(ordered)),
        "confidence": score_confidence(ordered, confidence),
        "legend": dict(zip(levels, criteria, strict=True)),
        "probabilities": dict(zip(levels, ordered, strict=True)),
    }


def build_response(encoded: EncodedRecord, probs: Sequence[np.ndarray],
                   confidence: Confidence = "jev") -> dict[str, Any]:
    """The ``/v1/systemone`` response for one encoded request; ``probs`` holds one vector per question (model
    order; entries past the question's options, e.g. padding, are ignored)."""
    request = encoded.request
    if request is None:
        raise ValueError("build_response needs the EncodedRecord of encode_request (it carries the request)")
    answers = {}
    for row, question in zip(probs, encoded.questions, strict=True):
        k = len(question.option_ids)
        answers[question.question_id] = build_answer(
            request.questions[question.question_id], question.option_ids, row[:k].tolist(), confidence
        )
    return {
        "model": request.model,
        "answers": answers,
        "usage": {"input_tokens": len(encoded.input_ids), "output_tokens": 0},
    }


def round_floats(value: Any, digits: int = 4) -> Any:
    """A copy of a JSON value with every float rounded (the wire format; the API keeps full precision)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: round_floats(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v, digits) for v in value]
    return value


def below_threshold(encoded: EncodedRecord, probs: Sequence[np.ndarray], thresholds: Mapping[str, float]) -> list[str]:
    """The ids of the questions whose top probability is under their type's threshold (``calibrate --error-budget``,
    docs/quality.md#selective-prediction), in request order; a type without a threshold is never marked."""
    marked = []
    for row, question in zip(probs, encoded.questions, strict=True):
        kind = QUESTION_TYPES[question.question_type]
        if kind in thresholds and float(np.max(row[: len(question.option_ids)])) < thresholds[kind]:
            marked.append(question.question_id)
    return marked
