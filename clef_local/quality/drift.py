"""Drift of a candidate (a quantized variant) against its reference on the same requests (docs/quality.md#drift):
:func:`question_drift`, :func:`compare_predictions`, :func:`summarize` (the names ``--gate`` uses), :func:`run_drift`
and :func:`drift_from_predictions` (one reference pass, many candidates); imported lazily by the UI. The result
types are :mod:`clef_local.quality.results`, the command line :mod:`clef_local.quality.drift_cli`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.errors import short
from clef_local.quality.compare import mcnemar
from clef_local.quality.intervals import (
    DEFAULT_INTERVALS,
    IntervalSettings,
    LabelledQuestions,
    RequestBootstrap,
    as_list,
    clopper_pearson,
    error_rate_interval,
    labelled_samples,
)
from clef_local.quality.metrics import labelled_report
from clef_local.quality.results import DriftResult, Progress, QuestionDrift, QuestionRow, gold_index
from clef_local.runtime.schema import QUESTION_TYPES

if TYPE_CHECKING:
    from clef_local.model import ClefModel, Prediction

log = logging.getLogger(__name__)

_EPS = 1e-12


def _as_dist(p: np.ndarray, name: str) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    if p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"{name} must be a non-empty vector of finite probabilities ≥ 0, got {p!r}")
    return p


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    # terms with p = 0 contribute 0; q is clipped so a candidate that zeroes an option gives a large, finite KL
    mask = p > 0
    value = np.sum(p[mask] * (np.log(p[mask]) - np.log(np.clip(q[mask], _EPS, None))))
    return max(float(value), 0.0)


def question_drift(p_ref: np.ndarray, p_cand: np.ndarray, kind: str, *, question_id: str = "",
                   request_index: int = -1) -> QuestionDrift:
    """Compare one question's reference and candidate option probabilities (same options, same order): KL(ref ‖ cand)
    and Jensen-Shannon in nats, max and RMS |Δp|, whether the argmax flipped (ties: the first option) and, for a
    score, the shift of the expected level."""
    if kind not in QUESTION_TYPES:
        raise ValueError(f"kind must be one of {', '.join(QUESTION_TYPES)}, got {kind!r}")
    p, q = _as_dist(p_ref, "p_ref"), _as_dist(p_cand, "p_cand")
    if p.shape != q.shape:
        raise ValueError(f"p_ref has {p.size} options and p_cand {q.size}; compare the same question's vectors")
    m = 0.5 * (p + q)
    diff = q - p
    shift = None
    if kind == "score":
        levels = np.arange(p.size)
        shift = float(levels @ q - levels @ p)
    return QuestionDrift(kind=kind, kl=_kl(p, q), js=0.5 * _kl(p, m) + 0.5 * _kl(q, m),
                         max_abs=float(np.abs(diff).max()), rms=float(np.sqrt(np.mean(diff**2))),
                         flipped=bool(int(np.argmax(p)) != int(np.argmax(q))), score_shift=shift,
                         question_id=question_id, request_index=request_index)


def compare_predictions(ref: Sequence[Prediction], cand: Sequence[Prediction]) -> list[QuestionDrift]:
    """Per-question drift of two aligned prediction lists (the same requests through both models)."""
    if len(ref) != len(cand):
        raise ValueError(f"{len(ref)} reference predictions but {len(cand)} candidate ones; run the same requests")
    out = []
    for n, (r, c) in enumerate(zip(ref, cand, strict=True)):
        for question, p, q in zip(r.encoded.questions, r.probabilities, c.probabilities, strict=True):
            k = len(question.option_ids)
            out.append(question_drift(p[:k], q[:k], QUESTION_TYPES[question.question_type],
                                      question_id=question.question_id, request_index=n))
    return out


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def summarize(drifts: Sequence[QuestionDrift]) -> dict[str, Any]:
    """Aggregate metrics over questions (the names the ``--gate`` expressions use)."""
    kl = np.array([d.kl for d in drifts], dtype=float)
    shifts = [d.score_shift for d in drifts if d.score_shift is not None]
    flips = sum(d.flipped for d in drifts)
    empty = not len(drifts)
    return {
        "questions": len(drifts),
        "kl_mean": None if empty else float(kl.mean()),
        "kl_p50": None if empty else float(np.percentile(kl, 50)),
        "kl_p99": None if empty else float(np.percentile(kl, 99)),
        "kl_max": None if empty else float(kl.max()),
        "js_mean": _mean([d.js for d in drifts]),
        "max_abs_max": None if empty else float(max(d.max_abs for d in drifts)),
        "max_abs_mean": _mean([d.max_abs for d in drifts]),
        "rms_mean": _mean([d.rms for d in drifts]),
        "flips": int(flips),
        "flip_rate": None if empty else flips / len(drifts),
        "score_shift_mean": _mean(shifts),
        "score_shift_mean_abs": _mean([abs(s) for s in shifts]),
    }


def summary_intervals(drifts: Sequence[QuestionDrift], boot: RequestBootstrap) -> dict[str, dict[str, list[Any]]]:
    """Intervals of the summary's means (bootstrap over requests) and of the flip rate (exact binomial over
    questions; ``flip_rate_requests`` is its bootstrap interval too, which allows for the questions of one request
    flipping together), overall ("all") and per question type."""
    kinds = np.array([d.kind for d in drifts])
    columns = {"kl_mean": [d.kl for d in drifts], "js_mean": [d.js for d in drifts],
               "max_abs_mean": [d.max_abs for d in drifts], "rms_mean": [d.rms for d in drifts]}
    flipped = np.array([d.flipped for d in drifts], dtype=float)
    shifts = np.array([np.nan if d.score_shift is None else d.score_shift for d in drifts])
    out: dict[str, dict[str, list[Any]]] = {}
    for kind in ("all", *[k for k in QUESTION_TYPES if k in set(kinds.tolist())]):
        mask = np.ones(len(drifts), bool) if kind == "all" else kinds == kind
        if not mask.any():
            continue
        entry = {name: as_list(boot.interval(boot.mean(np.asarray(values, float), mask)))
                 for name, values in columns.items()}
        entry["flip_rate"] = as_list(clopper_pearson(int(flipped[mask].sum()), int(mask.sum()),
                                                     boot.settings.confidence))
        entry["flip_rate_requests"] = as_list(boot.interval(boot.mean(flipped, mask)))
        scored = mask & np.isfinite(shifts)
        if scored.any():
            filled = np.nan_to_num(shifts)
            entry["score_shift_mean"] = as_list(boot.interval(boot.mean(filled, scored)))
            entry["score_shift_mean_abs"] = as_list(boot.interval(boot.mean(np.abs(filled), scored)))
        out[kind] = entry
    return out


def state_snippet(state: Any, limit: int = 160) -> str:
    from clef_local.runtime.encoding import render

    return short(render(state), limit)


def labelled_metrics(rows: Sequence[QuestionRow], boot: RequestBootstrap | None = None) -> dict[str, dict[str, Any]]:
    """Per question type (and "all"): both models' accuracy, macro-F1, NLL, Brier, ECE, adaptive ECE, deltas; with
    ``boot`` (resamples of the rows' requests) also their intervals, the deltas' paired intervals, both error rates'
    exact binomial bounds and McNemar's test of the two models' correct answers."""
    out: dict[str, dict[str, Any]] = {}
    labelled = [n for n, r in enumerate(rows) if r.gold is not None]
    if not labelled:
        return out
    gold_all = [int(rows[n].gold or 0) for n in labelled]
    options_all = [rows[n].options for n in labelled]
    ref_q = LabelledQuestions.build([rows[n].p_ref for n in labelled], gold_all, options_all)
    cand_q = LabelledQuestions.build([rows[n].p_cand for n in labelled], gold_all, options_all)
    sub = RequestBootstrap([rows[n].request_index for n in labelled], boot.settings) if boot is not None else None
    kinds = np.array([rows[n].kind for n in labelled])
    for kind in (*QUESTION_TYPES, "all"):
        mask = np.ones(len(labelled), bool) if kind == "all" else kinds == kind
        if not mask.any():
            continue
        chosen = [rows[labelled[i]] for i in np.flatnonzero(mask)]
        gold = [int(r.gold or 0) for r in chosen]
        options = [r.options for r in chosen]
        ref = labelled_report([np.asarray(r.p_ref) for r in chosen], gold, options)
        cand = labelled_report([np.asarray(r.p_cand) for r in chosen], gold, options)
        delta = {k: cand[k] - ref[k] for k in ref if k != "n"}
        out[kind] = {"reference": ref, "candidate": cand, "delta": delta}
        if sub is None:
            continue
        ref_s, cand_s = labelled_samples(sub, ref_q, mask), labelled_samples(sub, cand_q, mask)
        level = sub.settings.confidence
        out[kind]["intervals"] = {
            "reference": {k: as_list(sub.interval(v)) for k, v in ref_s.items()},
            "candidate": {k: as_list(sub.interval(v)) for k, v in cand_s.items()},
            "delta": {k: as_list(sub.interval(cand_s[k] - ref_s[k])) for k in ref_s},
            "error_rate": {"reference": as_list(error_rate_interval(ref_q.correct[mask].astype(bool), level)),
                           "candidate": as_list(error_rate_interval(cand_q.correct[mask].astype(bool), level))}}
        # McNemar's events are errors: only_a = the reference alone wrong, only_b = the candidate alone wrong
        out[kind]["mcnemar"] = mcnemar(ref_q.correct[mask] == 0, cand_q.correct[mask] == 0)
    return out


def drift_from_predictions(ref_preds: Sequence[Prediction], cand_preds: Sequence[Prediction],
                           requests: Sequence[Mapping[str, Any]], *, labels: Sequence[Mapping[str, Any]] | None = None,
                           reference_name: str = "reference", candidate_name: str = "candidate",
                           meta: Mapping[str, Any] | None = None,
                           intervals: IntervalSettings | None = DEFAULT_INTERVALS) -> DriftResult:
    """Build a :class:`DriftResult` from the two models' predictions of ``requests`` (aligned); with ``intervals``
    (None: point values only) every summary and labelled figure also gets its interval (quality/intervals.py)."""
    if labels is not None and len(labels) != len(requests):
        raise ValueError(f"{len(labels)} label sets for {len(requests)} requests; pass one (possibly empty) each")
    drifts = compare_predictions(ref_preds, cand_preds)
    rows = []
    index = 0
    for n, (r, c) in enumerate(zip(ref_preds, cand_preds, strict=True)):
        snippet = state_snippet(r.request.state)
        for question, p, q in zip(r.encoded.questions, r.probabilities, c.probabilities, strict=True):
            k = len(question.option_ids)
            label = labels[n].get(question.question_id) if labels is not None else None
            gold = None if label is None else gold_index(question.option_ids, label)
            rows.append(QuestionRow(n, question.question_id, QUESTION_TYPES[question.question_type],
                                    list(question.option_ids), [float(x) for x in p[:k]],
                                    [float(x) for x in q[:k]], drifts[index], gold, snippet))
            index += 1
    by_type: dict[str, dict[str, Any]] = {kind: summarize([d for d in drifts if d.kind == kind])
                                          for kind in QUESTION_TYPES if any(d.kind == kind for d in drifts)}
    boot = RequestBootstrap([d.request_index for d in drifts], intervals) if intervals is not None else None
    info = dict(meta or {})
    if intervals is not None:
        info["intervals"] = intervals.to_json()
    return DriftResult(reference=reference_name, candidate=candidate_name, summary=summarize(drifts),
                       by_type=by_type, rows=rows, labelled=labelled_metrics(rows, boot), meta=info,
                       intervals=summary_intervals(drifts, boot) if boot is not None and drifts else {})


def head_difference(reference: str | Path, candidate: str | Path) -> str | None:
    """Why the two releases' joint schema heads differ (the names of the head files whose bytes differ), or None.

    A variant copies its source's head byte for byte, so a difference means the candidate was exported from another
    release (e.g. before the reference's head was retrained): the drift then measures two models, not a scheme.
    """
    from clef_local.formats.manifest import sha256
    from clef_local.formats.release import HEAD_CONFIG, HEAD_WEIGHTS

    differ = [name for name in (HEAD_WEIGHTS, HEAD_CONFIG)
              if sha256(Path(reference) / name) != sha256(Path(candidate) / name)]
    if not differ:
        return None
    return (f"{candidate}: {' and '.join(differ)} differ from {reference}'s — this compares two different heads, "
            f"not a quantization; re-export the variant from this reference")


def run_drift(reference: ClefModel, candidate: ClefModel, requests: Sequence[Mapping[str, Any]], *,
              labels: Sequence[Mapping[str, Any]] | None = None, batch_size: int = 8,
              progress: Progress | None = None, reference_name: str | None = None,
              candidate_name: str | None = None,
              reference_predictions: Sequence[Prediction] | None = None) -> DriftResult:
    """Run ``requests`` through both loaded models and compare them question by question.

    ``progress(done, total)`` counts requests over both passes (total = 2 × requests, or 1 × when
    ``reference_predictions`` are given).
    """
    total = len(requests) * (1 if reference_predictions is not None else 2)
    offset = 0

    def step(done: int, _n: int) -> None:
        if progress is not None:
            progress(offset + done, total)

    if (difference := head_difference(reference.path, candidate.path)) is not None:
        log.warning("%s", difference)
    started = time.perf_counter()
    ref_preds = reference_predictions
    if ref_preds is None:
        ref_preds = reference.predict(requests, batch_size=batch_size, progress=step)
        offset = len(requests)
    ref_seconds = time.perf_counter() - started
    cand_preds = candidate.predict(requests, batch_size=batch_size, progress=step)
    cand_seconds = time.perf_counter() - started - ref_seconds
    result = drift_from_predictions(ref_preds, cand_preds, requests, labels=labels,
                                    reference_name=reference_name or str(reference.path),
                                    candidate_name=candidate_name or str(candidate.path))
    result.timing = {"reference_s": ref_seconds, "candidate_s": cand_seconds, "requests": float(len(requests))}
    return result


