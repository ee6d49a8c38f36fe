"""Selective prediction: answer only above a confidence threshold, chosen so the error stays within a budget.

``eval --error-budget 0.02`` picks, per question type, the lowest threshold on the top probability (the most
questions answered) whose error among the answered questions is at most the budget — **on the upper confidence
bound**, not on the point value, by default (docs/quality.md#selective-prediction):

- the thresholds tried are those that answer 2%, 4%, …, 100% of the questions (:data:`GRID_POINTS` of them, fixed
  in advance, so that the guarantee below does not depend on how the errors fall);
- each is tested with the exact one-sided binomial (Clopper–Pearson) upper bound at level ``1 − α/50`` (α = 1 −
  ``--confidence``), so that all of them hold together with probability ≥ 1 − α (Bonferroni), and the one that
  answers the most of those within the budget is chosen: it keeps the true error at or under the budget with that
  probability, for data like the evaluation set. (A bound is not monotone in the threshold — few answers give a
  loose bound however right they are — so the whole grid is tried, not a search that assumes it is.)
- ``bound="point"`` instead takes the lowest threshold whose observed error is within the budget (no guarantee:
  the realised error on new data is then often above the budget).

The coverage there is the share of questions answered. :func:`apply_thresholds` measures stored thresholds on other
data: the realised error on held-out rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from clef_local.quality.intervals import DEFAULT_CONFIDENCE, as_list, clopper_pearson
from clef_local.runtime.schema import QUESTION_TYPES

BOUNDS = ("upper", "point")
CURVE_POINTS = 200  # points of the risk-coverage curve kept in the JSON
GRID_POINTS = 50  # coverages tried on the upper bound: 2%, 4%, …, 100% of the questions


def upper_bound(errors: int, n: int, level: float) -> float:
    """The exact one-sided binomial upper bound of an error rate at ``level`` (1.0 when every answer is wrong)."""
    if n == 0:
        return math.nan
    if errors >= n:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(level, errors + 1, n - errors))


def _sorted(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-np.asarray(confidence, float), kind="stable")
    return np.asarray(confidence, float)[order], 1 - np.asarray(correct, float)[order]


def risk_coverage(confidence: np.ndarray, correct: np.ndarray) -> dict[str, np.ndarray]:
    """For every distinct threshold (highest first): ``threshold``, ``covered`` (questions with confidence ≥ it),
    ``errors`` among them, ``coverage`` and ``risk`` (their error rate). Ties stay together: one threshold each."""
    conf, wrong = _sorted(confidence, correct)
    if not conf.size:
        empty = np.array([])
        return {"threshold": empty, "covered": empty, "errors": empty, "coverage": empty, "risk": empty}
    ends = np.flatnonzero(np.r_[conf[1:] != conf[:-1], True])
    covered = ends + 1
    errors = np.cumsum(wrong)[ends]
    return {"threshold": conf[ends], "covered": covered, "errors": errors, "coverage": covered / conf.size,
            "risk": errors / covered}


def choose_threshold(confidence: np.ndarray, correct: np.ndarray, budget: float, *, bound: str = "upper",
                     confidence_level: float = DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """The threshold for one question type (module docstring): ``threshold`` (None: no threshold keeps the error
    within the budget, so answer nothing), ``coverage``, ``covered``, ``errors``, ``error`` (observed),
    ``error_bound`` (the bound it was chosen on), ``error_interval`` (the two-sided exact interval), ``tested``."""
    if not 0 < budget < 1:
        raise ValueError(f"error budget must be in (0, 1), got {budget}; e.g. 0.02 for at most 2% wrong answers")
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {', '.join(BOUNDS)}, got {bound!r}")
    curve = risk_coverage(confidence, correct)
    m = int(curve["threshold"].size)
    n = int(np.asarray(confidence).size)
    chosen: int | None = None
    tested = 0
    level = confidence_level
    if m and bound == "point":
        passing = np.flatnonzero(curve["risk"] <= budget)
        chosen = int(passing.max()) if passing.size else None
        tested = m
    elif m:
        level = 1 - (1 - confidence_level) / GRID_POINTS  # Bonferroni over the thresholds tried
        # the threshold at each of GRID_POINTS evenly spaced coverages (ties keep a threshold's questions together)
        ranks = np.ceil(np.arange(1, GRID_POINTS + 1) * n / GRID_POINTS).astype(int)
        tried = np.unique(np.searchsorted(curve["covered"], ranks, side="left").clip(0, m - 1))
        tested = int(tried.size)
        for z in tried:
            if upper_bound(int(curve["errors"][z]), int(curve["covered"][z]), level) <= budget:
                chosen = int(z)  # tried is ascending in coverage: the last that passes answers the most
    out: dict[str, Any] = {"n": n, "budget": budget, "bound": bound, "tested": tested,
                           "bound_level": level if bound == "upper" else None}
    if chosen is None:
        return {**out, "threshold": None, "coverage": 0.0, "covered": 0, "errors": 0, "error": None,
                "error_bound": None, "error_interval": [None, None]}
    covered, errors = int(curve["covered"][chosen]), int(curve["errors"][chosen])
    return {**out, "threshold": float(curve["threshold"][chosen]), "coverage": covered / n, "covered": covered,
            "errors": errors, "error": errors / covered,
            "error_bound": upper_bound(errors, covered, level) if bound == "upper" else errors / covered,
            "error_interval": as_list(clopper_pearson(errors, covered, confidence_level))}


def curve_points(confidence: np.ndarray, correct: np.ndarray) -> list[list[float]]:
    """``[coverage, risk]`` pairs of the risk-coverage curve, thinned to about :data:`CURVE_POINTS`."""
    curve = risk_coverage(confidence, correct)
    keep = np.unique(np.linspace(0, max(curve["coverage"].size - 1, 0), CURVE_POINTS).astype(int))
    return [[float(curve["coverage"][i]), float(curve["risk"][i])] for i in keep] if curve["coverage"].size else []


Question = tuple[str, float, bool]  # (question type, confidence: the top probability, answered correctly)


def _by_type(questions: Sequence[Question]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for kind in QUESTION_TYPES:
        chosen = [(c, ok) for k, c, ok in questions if k == kind]
        if chosen:
            out[kind] = (np.array([c for c, _ in chosen]), np.array([ok for _, ok in chosen], dtype=float))
    return out


def error_budget(questions: Sequence[Question], budget: float, *, bound: str = "upper",
                 confidence_level: float = DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """:func:`choose_threshold` per question type, with each type's risk-coverage curve."""
    types = {}
    for kind, (conf, ok) in _by_type(questions).items():
        types[kind] = {**choose_threshold(conf, ok, budget, bound=bound, confidence_level=confidence_level),
                       "curve": curve_points(conf, ok)}
    return {"budget": budget, "bound": bound, "confidence": confidence_level, "types": types}


def apply_thresholds(questions: Sequence[Question], thresholds: Mapping[str, float],
                     confidence_level: float = DEFAULT_CONFIDENCE) -> dict[str, Any]:
    """Coverage and realised error of stored ``thresholds`` (type → threshold) on ``questions``, per type and over
    all the types that have one, with the error's exact interval."""
    out: dict[str, Any] = {}
    pooled_covered = pooled_errors = pooled_n = 0
    for kind, (conf, ok) in _by_type(questions).items():
        if kind not in thresholds:
            continue
        answered = conf >= thresholds[kind]
        covered, errors = int(answered.sum()), int((answered & (ok == 0)).sum())
        pooled_covered, pooled_errors, pooled_n = pooled_covered + covered, pooled_errors + errors, pooled_n + conf.size
        out[kind] = {"threshold": float(thresholds[kind]), "n": int(conf.size), "covered": covered,
                     "coverage": covered / conf.size, "errors": errors,
                     "error": errors / covered if covered else None,
                     "error_interval": as_list(clopper_pearson(errors, covered, confidence_level))}
    if len(out) > 1:
        out["all"] = {"threshold": None, "n": pooled_n, "covered": pooled_covered,
                      "coverage": pooled_covered / pooled_n, "errors": pooled_errors,
                      "error": pooled_errors / pooled_covered if pooled_covered else None,
                      "error_interval": as_list(clopper_pearson(pooled_errors, pooled_covered, confidence_level))}
    return out
