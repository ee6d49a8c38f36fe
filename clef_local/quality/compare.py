"""Which of two variants is closer to the reference, and is the difference real? (docs/quality.md#intervals)

Both candidates answered the same questions, so the tests are paired:

- :func:`mcnemar`: the exact McNemar test on two paired yes/no outcomes (a flip, or a correct answer): only the
  questions where the two disagree carry information, and under "no difference" each of them is a fair coin —
  a two-sided exact binomial test on the discordant counts.
- :func:`paired_difference`: the difference of two per-question figures (KL) averaged over the same resamples of
  requests (:class:`~clef_local.quality.intervals.RequestBootstrap`), with its interval and a two-sided bootstrap
  p-value (twice the share of resamples on the far side of zero).

:func:`compare_candidates` runs both on every pair of candidates of one drift run: the first table of the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.quality.intervals import DEFAULT_INTERVALS, IntervalSettings, RequestBootstrap, as_list
from clef_local.quality.results import DriftResult


def mcnemar(a: Sequence[bool] | np.ndarray, b: Sequence[bool] | np.ndarray) -> dict[str, Any]:
    """Exact McNemar test of paired outcomes ``a`` and ``b`` (True: the event happened): ``only_a``, ``only_b`` (the
    discordant counts) and the two-sided ``p_value`` (1.0 when they never disagree)."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have one entry per question each, got {a.shape} and {b.shape}")
    only_a, only_b = int((a & ~b).sum()), int((b & ~a).sum())
    if only_a + only_b == 0:
        return {"only_a": 0, "only_b": 0, "p_value": 1.0}
    from scipy.stats import binomtest

    p = float(binomtest(only_a, only_a + only_b, 0.5, alternative="two-sided").pvalue)
    return {"only_a": only_a, "only_b": only_b, "p_value": min(p, 1.0)}


def paired_difference(boot: RequestBootstrap, a: np.ndarray, b: np.ndarray,
                      mask: np.ndarray | None = None) -> dict[str, Any]:
    """``mean(b) − mean(a)`` over the questions, its bootstrap interval and two-sided p-value (the same resamples
    for both: paired)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    keep = np.ones(a.size, bool) if mask is None else np.asarray(mask, bool)
    samples = boot.mean(b, keep) - boot.mean(a, keep)
    samples = samples[np.isfinite(samples)]
    point = float(b[keep].mean() - a[keep].mean()) if keep.any() else float("nan")
    if not samples.size:
        return {"difference": point, "interval": [None, None], "p_value": None}
    p = 2 * min(float((samples <= 0).mean()), float((samples >= 0).mean()))
    return {"difference": point, "interval": as_list(boot.interval(samples)), "p_value": min(p, 1.0)}


def _same_questions(a: DriftResult, b: DriftResult) -> None:
    keys_a = [(r.request_index, r.question_id) for r in a.rows]
    keys_b = [(r.request_index, r.question_id) for r in b.rows]
    if keys_a != keys_b:
        raise ValueError(f"{a.candidate} and {b.candidate} did not answer the same questions; compare candidates of "
                         "one drift run")


def _name(path: str) -> str:
    return Path(path).name or path


def compare_pair(a: DriftResult, b: DriftResult, boot: RequestBootstrap, alpha: float) -> dict[str, Any]:
    """One pair's comparison: flips (McNemar), mean KL (paired bootstrap), correctness where labelled (McNemar),
    and which candidate is closer to the reference when the difference is significant at ``alpha``."""
    _same_questions(a, b)
    flips = mcnemar([r.drift.flipped for r in a.rows], [r.drift.flipped for r in b.rows])
    kl = paired_difference(boot, np.array([r.drift.kl for r in a.rows]), np.array([r.drift.kl for r in b.rows]))
    entry: dict[str, Any] = {
        "a": a.candidate, "b": b.candidate,
        "flip_rate": [a.summary["flip_rate"], b.summary["flip_rate"]], "flips": flips,
        "kl_mean": [a.summary["kl_mean"], b.summary["kl_mean"]], "kl": kl,
    }
    labelled = [i for i, r in enumerate(a.rows) if r.gold is not None]
    if labelled:
        right_a = [int(np.argmax(a.rows[i].p_cand)) == a.rows[i].gold for i in labelled]
        right_b = [int(np.argmax(b.rows[i].p_cand)) == b.rows[i].gold for i in labelled]
        entry["accuracy"] = [float(np.mean(right_a)), float(np.mean(right_b))]
        entry["correct"] = mcnemar(right_a, right_b)
    kl_p = kl["p_value"]
    if kl_p is not None and kl_p < alpha:
        closer = _name(a.candidate if kl["difference"] > 0 else b.candidate)
        entry["verdict"] = f"{closer} is closer (KL, p={kl_p:.2g})"
    elif flips["p_value"] < alpha:
        fewer = _name(a.candidate if flips["only_b"] > flips["only_a"] else b.candidate)
        entry["verdict"] = f"{fewer} flips less (p={flips['p_value']:.2g}); KL not significantly different"
    else:
        entry["verdict"] = f"no significant difference at {1 - alpha:.0%}"
    return entry


def compare_candidates(results: Sequence[DriftResult],
                       settings: IntervalSettings = DEFAULT_INTERVALS) -> list[dict[str, Any]]:
    """Every pair of candidates of one drift run (the same requests), in the order given."""
    if len(results) < 2:
        return []
    boot = RequestBootstrap([r.request_index for r in results[0].rows], settings)
    return [compare_pair(a, b, boot, 1 - settings.confidence) for a, b in combinations(results, 2)]
