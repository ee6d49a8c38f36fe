"""Confidence intervals for the quality figures (docs/quality.md#intervals).

Two methods, each chosen for what it bounds:

- **Exact binomial** (Clopper–Pearson, :func:`clopper_pearson`) for rates of events counted over questions — flips
  and errors: the interval inverts two one-sided binomial tests, so it never covers the true rate less often than
  its level says (it is conservative at small counts), with no normal approximation to fail at 0 or 1 events.
- **A bootstrap over requests** (:class:`RequestBootstrap`) for every other figure (KL, JS, |Δp|, accuracy, macro-F1,
  NLL, Brier, ECE): the questions of one request share a state and a forward pass, so they are not independent;
  resampling whole requests keeps that dependence in the interval. It is *paired*: one set of resamples serves the
  reference, every candidate and their differences, so a difference's interval is that of the same requests seen
  by both models. Resamples are drawn from a seeded generator: the same data, seed and resample count give the
  same interval, bit for bit.

Each resample is a vector of request counts (multinomial, summing to the number of requests), so a mean over the
questions of a resample is ``counts @ per-request sums / counts @ per-request counts``: a matrix product, not a loop.
The interval is the percentile interval of the resampled statistic.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
MIN_RESAMPLES = 100  # below this the 2.5% / 97.5% percentiles rest on two or three resamples
Interval = tuple[float, float]


@dataclass(frozen=True)
class IntervalSettings:
    """How intervals are computed: their level, the bootstrap's resamples and its seed."""

    confidence: float = DEFAULT_CONFIDENCE
    resamples: int = DEFAULT_RESAMPLES
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}; e.g. 0.95 for 95% intervals")
        if self.resamples < MIN_RESAMPLES:
            raise ValueError(f"resamples must be ≥ {MIN_RESAMPLES}, got {self.resamples}; the interval's ends are "
                             f"percentiles of the resamples (1000 is the usual choice)")

    @property
    def percent(self) -> str:
        """The level as gates name it: ``95`` for 0.95, ``99.5`` for 0.995."""
        return f"{100 * self.confidence:g}"

    def to_json(self) -> dict[str, float | int | str]:
        return {**asdict(self), "bootstrap": "requests, paired, percentile", "rates": "Clopper-Pearson"}


DEFAULT_INTERVALS = IntervalSettings()


def clopper_pearson(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    """The exact two-sided binomial interval for ``k`` events in ``n`` trials: ``(nan, nan)`` when ``n`` is 0."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 ≤ k ≤ n, got k={k}, n={n}")
    if n == 0:
        return math.nan, math.nan
    from scipy.stats import beta

    alpha = 1 - confidence
    low = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def percentile_interval(samples: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    """The central ``confidence`` percentile interval of resampled values (resamples that are NaN are left out:
    a resample with no question of a type has no value for that type)."""
    values = np.asarray(samples, dtype=np.float64)
    values = values[np.isfinite(values)]
    if not values.size:
        return math.nan, math.nan
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def as_list(interval: Interval) -> list[float | None]:
    """An interval for JSON: ``[low, high]`` with ``None`` for an undefined end (JSON has no NaN)."""
    return [None if not math.isfinite(v) else float(v) for v in interval]


class RequestBootstrap:
    """Resamples of the requests behind a set of questions, shared by every statistic computed on them.

    ``requests`` holds, for each question, the index of its request; questions with the same index move together.
    ``counts`` is ``[resamples, requests]``: how often each request appears in each resample.
    """

    def __init__(self, requests: Sequence[int] | np.ndarray, settings: IntervalSettings = DEFAULT_INTERVALS) -> None:
        self.settings = settings
        request_ids = np.asarray(requests, dtype=np.int64).reshape(-1)
        _, self.group = np.unique(request_ids, return_inverse=True)
        self.n_requests = int(self.group.max()) + 1 if self.group.size else 0
        rng = np.random.default_rng(settings.seed)
        if self.n_requests:
            self.counts = rng.multinomial(self.n_requests, np.full(self.n_requests, 1.0 / self.n_requests),
                                          size=settings.resamples).astype(np.float64)
        else:
            self.counts = np.zeros((settings.resamples, 0))

    @property
    def questions(self) -> int:
        return int(self.group.size)

    def _sums(self, values: np.ndarray) -> np.ndarray:
        """Per-request sums of ``values`` ([questions] → [requests], or [questions, k] → [requests, k])."""
        values = np.asarray(values, dtype=np.float64)
        out = np.zeros((self.n_requests, *values.shape[1:]))
        np.add.at(out, self.group, values)
        return out

    def mean(self, values: Sequence[float] | np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """The mean of ``values`` over the (masked) questions of each resample: ``[resamples]`` (NaN where a resample
        holds none of them)."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.questions,):
            raise ValueError(f"expected {self.questions} values (one per question), got shape {values.shape}")
        weight = np.ones(self.questions) if mask is None else np.asarray(mask, dtype=np.float64)
        total = self.counts @ self._sums(values * weight)
        n = self.counts @ self._sums(weight)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, total / np.where(n > 0, n, 1), np.nan)

    def ece(self, confidence: np.ndarray, correct: np.ndarray, mask: np.ndarray | None = None,
            bins: int = 15) -> np.ndarray:
        """ECE (equal-width bins, as :func:`clef_local.quality.metrics.ece` bins) of each resample:
        ``Σ_b |Σ_{q∈b} (correct − confidence)| / n``."""
        confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
        weight = np.ones(self.questions) if mask is None else np.asarray(mask, dtype=np.float64)
        edges = np.linspace(0.0, 1.0, bins + 1)
        which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
        gap = np.zeros((self.questions, bins))
        gap[np.arange(self.questions), which] = (correct - confidence) * weight
        n = self.counts @ self._sums(weight)
        per_bin = np.abs(self.counts @ self._sums(gap))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, per_bin.sum(axis=1) / np.where(n > 0, n, 1), np.nan)

    def macro_f1(self, predicted: Sequence[str], gold: Sequence[str], mask: np.ndarray | None = None) -> np.ndarray:
        """Macro-F1 of each resample over the classes it holds (a class absent from a resample, as gold and as
        prediction, is not averaged in: :func:`clef_local.quality.metrics.macro_f1` on the resample's questions)."""
        keep = np.ones(self.questions, bool) if mask is None else np.asarray(mask, bool)
        classes = sorted({c for c, k in zip(predicted, keep, strict=True) if k}
                         | {c for c, k in zip(gold, keep, strict=True) if k})
        index = {c: i for i, c in enumerate(classes)}
        tp, fp, fn = (np.zeros((self.questions, len(classes))) for _ in range(3))
        for q, (p, g) in enumerate(zip(predicted, gold, strict=True)):
            if not keep[q]:
                continue
            if p == g:
                tp[q, index[p]] = 1
            else:
                fp[q, index[p]] = 1
                fn[q, index[g]] = 1
        tp_b, fp_b, fn_b = (self.counts @ self._sums(m) for m in (tp, fp, fn))
        denominator = 2 * tp_b + fp_b + fn_b
        present = denominator > 0
        with np.errstate(invalid="ignore", divide="ignore"):
            f1 = np.where(present, 2 * tp_b / np.where(present, denominator, 1), 0.0)
            return np.where(present.any(axis=1), f1.sum(axis=1) / present.sum(axis=1), np.nan)

    def adaptive_ece(self, confidence: np.ndarray, correct: np.ndarray, mask: np.ndarray | None = None,
                     bins: int = 15) -> np.ndarray:
        """Adaptive ECE (equal-count bins) of each resample; a loop over resamples, since the bins move with them."""
        confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
        keep = np.ones(self.questions, bool) if mask is None else np.asarray(mask, bool)
        chosen = np.flatnonzero(keep)
        order = chosen[np.argsort(confidence[chosen], kind="stable")]
        out = np.full(self.counts.shape[0], np.nan)
        for b, counts in enumerate(self.counts):
            sample = np.repeat(order, counts[self.group[order]].astype(np.int64))  # sorted by confidence still
            if not sample.size:
                continue
            total = 0.0
            for members in np.array_split(sample, bins):
                if members.size:
                    total += members.size / sample.size * abs(correct[members].mean() - confidence[members].mean())
            out[b] = total
        return out

    def interval(self, samples: np.ndarray) -> Interval:
        return percentile_interval(samples, self.settings.confidence)


@dataclass(frozen=True)
class LabelledQuestions:
    """Labelled questions as the resampled metrics need them: the top option, confidence, gold and per-question loss
    terms, computed once from each question's probability vector (``options``: its option ids, so macro-F1 counts
    classes by name as :func:`clef_local.quality.metrics.labelled_report` does)."""

    correct: np.ndarray
    confidence: np.ndarray
    nll: np.ndarray
    brier: np.ndarray
    predicted: list[str]
    gold: list[str]

    @classmethod
    def build(cls, probs: Sequence[Sequence[float] | np.ndarray], gold: Sequence[int],
              options: Sequence[Sequence[str]] | None = None) -> LabelledQuestions:
        vectors = [np.asarray(p, dtype=np.float64).reshape(-1) for p in probs]
        pred = [int(np.argmax(p)) for p in vectors]
        names = options or [[str(i) for i in range(len(p))] for p in vectors]
        return cls(correct=np.array([p == g for p, g in zip(pred, gold, strict=True)], dtype=float),
                   confidence=np.array([float(p.max()) for p in vectors]),
                   nll=np.array([-math.log(min(max(float(p[g]), 1e-12), 1.0)) for p, g in zip(vectors, gold,
                                                                                           strict=True)]),
                   brier=np.array([float(((p - np.eye(len(p))[g]) ** 2).sum()) for p, g in zip(vectors, gold,
                                                                                          strict=True)]),
                   predicted=[str(o[i]) for o, i in zip(names, pred, strict=True)],
                   gold=[str(o[i]) for o, i in zip(names, gold, strict=True)])


def labelled_samples(boot: RequestBootstrap, questions: LabelledQuestions,
                     mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Each labelled metric of :func:`clef_local.quality.metrics.labelled_report` on every resample of ``boot``."""
    return {"accuracy": boot.mean(questions.correct, mask), "macro_f1": boot.macro_f1(questions.predicted,
                                                                                         questions.gold, mask),
            "nll": boot.mean(questions.nll, mask), "brier": boot.mean(questions.brier, mask),
            "ece": boot.ece(questions.confidence, questions.correct, mask),
            "adaptive_ece": boot.adaptive_ece(questions.confidence, questions.correct, mask),
            "confidence": boot.mean(questions.confidence, mask)}


def error_rate_interval(correct: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    """Clopper–Pearson bounds of the error rate (questions answered wrong, out of all)."""
    correct = np.asarray(correct, bool)
    return clopper_pearson(int((~correct).sum()), int(correct.size), confidence)


def add_interval_flags(parser: argparse.ArgumentParser) -> None:
    """``--confidence``, ``--resamples``, ``--seed``: the intervals of drift, eval and probe."""
    parser.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE,
                        help=f"the intervals' level (default {DEFAULT_CONFIDENCE}; gates name it: @upper95)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES,
                        help=f"bootstrap resamples of the requests (default {DEFAULT_RESAMPLES})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"the bootstrap's seed (default {DEFAULT_SEED}): the same seed, the same intervals")


def interval_settings(args: argparse.Namespace) -> IntervalSettings:
    """The :class:`IntervalSettings` of ``add_interval_flags``' flags (ValueError naming a bad one)."""
    return IntervalSettings(confidence=args.confidence, resamples=args.resamples, seed=args.seed)
