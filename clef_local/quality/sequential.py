"""A sequential verdict for export validation (docs/quantization.md#the-verdict-sequentially).

The probe set runs in growing batches; after each, :func:`look` bounds each gated metric and says ``pass`` (every
upper bound within its limit), ``fail`` (some lower bound over its limit) or ``continue``; at the schedule's last
look ``continue`` becomes ``undecided``. The procedure, exactly:

- **Looks** (:func:`schedule`): after ``first`` requests, then doubling, the last after ``max_requests``; fixed
  before any data is seen.
- **Spending**: look ``k`` spends ``level_k = alpha · (n_k − n_{k−1}) / n_K`` (linear in the requests seen, so
  ``Σ level_k = alpha``). Every bound at look ``k`` is one-sided: the *upper* bound of each metric at ``level_k``;
  the *lower* bound of each at ``level_k / M`` (``M`` gated metrics).
- **Errors**: a wrong pass needs the upper bound of a metric whose true value is over its limit to fall under its
  true value, at some look: ≤ ``Σ_k level_k = alpha`` (union bound over the looks; one such metric suffices). A
  wrong refusal needs some metric's lower bound over its true value (≤ its limit): ≤ ``Σ_k Σ_m level_k / M =
  alpha``. The union bound holds for any schedule and any dependence between looks; it is conservative.
- **Flip rate**: the exact one-sided Clopper–Pearson bounds of ``flips`` among ``questions``, at the effective
  counts ``flips / d`` of ``questions / d`` where ``d ≥ 1`` is the design effect of flips clustered in requests
  (Korn & Graubard 1998; ``d = 1``, plain Clopper–Pearson, when requests hold one question or flips do not
  cluster). Without it, flips that come together in a request (a borderline message flips several of its
  questions) make the binomial bound too narrow: simulated at the limit, a wrong-pass rate over alpha.
- **Mean KL**: over *requests* (the questions of a request share a forward pass): the ratio mean
  ``Σ KL / Σ questions`` with its linearized request-level standard error ``se``. Upper bound: ``mean + se ·
  max(t, h, √((1 − a)/a))`` at level ``a``: the Student-t quantile (``n − 1`` df), Hall's (1992) skewness-corrected
  one, and Cantelli's one-sided Chebyshev factor. Per-question KL is right-skewed and heavy-tailed (most questions
  near 0, a few near a decision boundary far out): the sample mean is then mostly *below* the true mean and the
  standard error with it, so t, Hall and a percentile bootstrap all let the upper bound fall under a true mean at
  the limit several times more often than their level at the small levels of the first looks; Cantelli's factor
  holds it in the simulated cases but for the heaviest tail at the smallest request counts. Conservative, and it
  costs little: a good variant's mean KL sits far under its limit, and the flip rate is what takes the requests.
  Lower bound: ``mean − se · max(t, h)`` at ``a / M``, never below 0 (skewness makes it cover *more* than its
  level: a high mean comes with a high spread). Analytic rather than resampled, so that its small levels need no
  10⁴ resamples per look and the simulation (benchmarks/verdict_simulation.py) runs the same code.

The design effect is estimated from the same data (noisy with few flips), so the flip bound's level is approximate
when flips cluster; the simulation has clustered flips. Pure numpy; scipy is imported when a bound is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

log = logging.getLogger(__name__)

ALPHA = 0.05  # each error (a wrong pass, a wrong refusal) at most 5% over the whole run: drift's @upper95 gates' 5%
# 16 requests (~32 questions): the fewest at which a broken variant (40% flips) is refused at the first look nearly
# always; at 8, a first look's small level refuses it there only about half the time (benchmarks/verdict_simulation.py)
FIRST_LOOK = 16
GATEABLE = ("mean_kl", "flip_rate")
VERDICTS = ("pass", "fail", "continue", "undecided")


@dataclass(frozen=True)
class Schedule:
    """When the verdict is looked at (cumulative request counts) and the overall error ``alpha`` it may spend."""

    looks: tuple[int, ...]
    alpha: float

    def __post_init__(self) -> None:
        if not self.looks or any(n < 1 for n in self.looks) or any(
                b <= a for a, b in zip(self.looks, self.looks[1:], strict=False)):
            raise ValueError(f"looks must be increasing positive request counts, got {self.looks}; e.g. "
                             f"schedule(256).looks = (16, 32, 64, 128, 256)")
        if not 0 < self.alpha < 0.5:
            raise ValueError(f"alpha must be in (0, 0.5), got {self.alpha}; e.g. {ALPHA}")

    def level(self, k: int) -> float:
        """The error spent at look ``k`` (0-based): ``alpha`` × the share of the last look's requests it adds."""
        if not 0 <= k < len(self.looks):
            raise ValueError(f"look {k} is not in this schedule's 0…{len(self.looks) - 1}")
        before = self.looks[k - 1] if k else 0
        # the tiny shave keeps Σ level ≤ alpha in floating point
        return self.alpha * (self.looks[k] - before) / self.looks[-1] * (1 - 1e-12)

    def levels(self, k: int, metrics: int) -> tuple[float, float]:
        """Look ``k``'s one-sided levels: (upper bounds', lower bounds') with ``metrics`` gated metrics."""
        if metrics < 1:
            raise ValueError(f"need at least one gated metric, got {metrics}")
        level = self.level(k)
        return level, level / metrics

    def to_json(self) -> dict[str, object]:
        return {"looks": list(self.looks), "alpha": self.alpha,
                "levels": [self.level(k) for k in range(len(self.looks))],
                "spending": "linear in requests, union bound over looks; lower bounds split over the metrics"}


def schedule(max_requests: int, *, first: int = FIRST_LOOK, alpha: float = ALPHA) -> Schedule:
    """Looks after ``first`` requests, doubling, and after ``max_requests`` last (a doubled look within 1.5× of the
    last is dropped: it would spend error on a look that adds little). ValueError naming the fix when
    ``max_requests`` or ``first`` is < 1."""
    if max_requests < 1:
        raise ValueError(f"max_requests must be ≥ 1, got {max_requests}; pass --validation-requests N with N ≥ 1 "
                         f"(a verdict needs requests to look at)")
    if first < 1:
        raise ValueError(f"first must be ≥ 1, got {first}; e.g. {FIRST_LOOK}")
    looks = []
    n = first
    while n < max_requests:
        looks.append(n)
        n *= 2
    if looks and looks[-1] * 1.5 > max_requests and len(looks) > 1:
        looks.pop()
    return Schedule((*looks, max_requests), alpha)


# ---------------------------------------------------------------------------------------------------- the bounds


def flip_bounds(flips: np.ndarray | float, questions: np.ndarray | float, upper_level: float,
                lower_level: float, deff: np.ndarray | float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper–Pearson bounds (lower at ``lower_level``, upper at ``upper_level``) of the rate of
    ``flips`` events among ``questions`` (arrays broadcast; ``(0, 1)`` where ``questions`` is 0); with a design
    effect ``deff`` > 1, at the effective counts ``flips / deff`` of ``questions / deff`` (Korn & Graubard 1998:
    clustered questions carry less information than as many independent ones)."""
    from scipy.stats import beta

    k = np.asarray(flips, dtype=np.float64) / deff
    n = np.asarray(questions, dtype=np.float64) / deff
    with np.errstate(invalid="ignore", divide="ignore"):
        upper = np.where(k >= n, 1.0, beta.ppf(1 - upper_level, k + 1, np.maximum(n - k, 1e-300)))
        lower = np.where(k <= 0, 0.0, beta.ppf(lower_level, np.maximum(k, 1e-300), n - k + 1))
    return np.where(n > 0, lower, 0.0), np.where(n > 0, upper, 1.0)


def can_pass(schedule: Schedule, questions: int, limits: Mapping[str, float]) -> str | None:
    """Why no outcome of ``questions`` questions could pass (None: a pass is possible): with no flip at all, the
    flip rate's upper bound at any look is at best that of the last, over every question; when that is over the
    limit the verdict can only be a failure or undecided, which an export should learn before it quantizes."""
    if "flip_rate" not in limits:
        return None
    level = max(schedule.level(k) for k in range(len(schedule.looks)))
    best = float(flip_bounds(0, questions, level, level)[1])
    if best <= limits["flip_rate"]:
        return None
    needed = math.ceil(math.log(level) / math.log1p(-limits["flip_rate"]))
    return (f"{schedule.looks[-1]} requests ({questions} questions) cannot show a flip rate ≤ "
            f"{limits['flip_rate']:g}: with no flip at all its upper bound would be {best:.3g}; that takes at least "
            f"~{needed} questions")


@dataclass(frozen=True)
class RequestMoments:
    """Sufficient statistics of a ratio mean over requests: per-request sums ``S_r`` (of KL) and counts ``m_r``
    (questions), summed as power products so that many simulated runs are bounded at once (arrays)."""

    n: np.ndarray      # requests
    m1: np.ndarray     # Σ m
    s1: np.ndarray     # Σ S
    s2: np.ndarray     # Σ S²
    sm: np.ndarray     # Σ S·m
    m2: np.ndarray     # Σ m²
    s3: np.ndarray     # Σ S³
    s2m: np.ndarray    # Σ S²·m
    sm2: np.ndarray    # Σ S·m²
    m3: np.ndarray     # Σ m³

    @classmethod
    def of(cls, sums: np.ndarray, counts: np.ndarray) -> RequestMoments:
        """From per-request sums and question counts, requests on the last axis (zero-count requests are absent)."""
        s, m = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
        return cls(n=(m > 0).sum(axis=-1).astype(np.float64), m1=m.sum(-1), s1=s.sum(-1), s2=(s * s).sum(-1),
                   sm=(s * m).sum(-1), m2=(m * m).sum(-1), s3=(s ** 3).sum(-1), s2m=(s * s * m).sum(-1),
                   sm2=(s * m * m).sum(-1), m3=(m ** 3).sum(-1))

    @classmethod
    def from_questions(cls, values: np.ndarray, request_of: np.ndarray) -> RequestMoments:
        """From per-question values and each question's request index."""
        _, group = np.unique(np.asarray(request_of), return_inverse=True)
        sums = np.bincount(group, weights=np.asarray(values, np.float64))
        return cls.of(sums, np.bincount(group).astype(np.float64))

    @property
    def mean(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.s1 / self.m1

    def spread(self) -> tuple[np.ndarray, np.ndarray]:
        """(standard error, skewness) of the mean: of ``z_r = (S_r − mean·m_r) / m̄``, the ratio estimator's
        linearization (``Σ z_r = 0``)."""
        x, n = self.mean, self.n
        with np.errstate(invalid="ignore", divide="ignore"):
            mbar = self.m1 / n
            z2 = (self.s2 - 2 * x * self.sm + x * x * self.m2) / mbar ** 2
            z3 = (self.s3 - 3 * x * self.s2m + 3 * x * x * self.sm2 - x ** 3 * self.m3) / mbar ** 3
            z2 = np.maximum(z2, 0.0)
            sd = np.sqrt(z2 / np.maximum(n - 1, 1))
            skew = np.where(z2 > 0, (z3 / n) / np.maximum(z2 / n, 1e-300) ** 1.5, 0.0)
        return sd / np.sqrt(n), skew


def design_effect(moments: RequestMoments) -> np.ndarray:
    """Kish's design effect of a rate over clustered questions: the variance of ``Σ events / Σ questions`` over
    requests (the ratio estimator's linearization, ``1/n`` like the binomial's) over the binomial variance, at least
    1 (Korn & Graubard 1998 truncate it so, so that no clustering leaves the exact bound as it is): exactly 1 when
    every request has one question; 1 where the rate is 0 or 1."""
    p, n = moments.mean, moments.n
    with np.errstate(invalid="ignore", divide="ignore"):
        mbar = moments.m1 / n
        z2 = (moments.s2 - 2 * p * moments.sm + p * p * moments.m2) / mbar ** 2
        clustered = np.maximum(z2, 0.0) / n ** 2
        binomial = p * (1 - p) / moments.m1
        deff = np.where(binomial > 0, clustered / np.where(binomial > 0, binomial, 1.0), 1.0)
    return np.maximum(np.nan_to_num(deff, nan=1.0), 1.0)


def _hall_inverse(y: np.ndarray | float, skew: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``t`` with ``g(t) = y`` for Hall's transform ``g(t) = t + a·t² + a²·t³/3 + b`` (``a = γ/(3√n)``,
    ``b = γ/(6√n)``), monotone: ``g(t) = ((1 + a·t)³ − 1)/(3a) + b``."""
    a = skew / (3 * np.sqrt(n))
    b = skew / (6 * np.sqrt(n))
    small = np.abs(a) < 1e-9
    safe = np.where(small, 1.0, a)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(small, y - b, (np.cbrt(1 + 3 * safe * (y - b)) - 1) / safe)


def mean_bounds(moments: RequestMoments, upper_level: float, lower_level: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lower, upper, standard error) of the ratio mean over requests (the module docstring): the upper end
    ``mean + se · max(t, Hall, Cantelli)``, the lower ``mean − se · max(t, Hall)`` and never below 0 (KL is not);
    ``(0, inf)`` with fewer than 2 requests."""
    from scipy.stats import norm, t

    x, n = moments.mean, moments.n
    se, skew = moments.spread()
    df = np.maximum(n - 1, 1)
    t_up, t_low = t.ppf(1 - upper_level, df), t.ppf(1 - lower_level, df)
    hall_up = -_hall_inverse(norm.ppf(upper_level), skew, n)   # the statistic's lower quantile, negated
    hall_low = _hall_inverse(norm.ppf(1 - lower_level), skew, n)
    # heavy right tails make t and Hall too low (module docstring): Cantelli's factor holds the level
    cantelli = math.sqrt((1 - upper_level) / upper_level)
    upper = x + se * np.fmax(np.fmax(t_up, hall_up), cantelli)
    lower = x - se * np.fmax(t_low, hall_low)
    ok = n >= 2
    return (np.where(ok, np.maximum(lower, 0.0), 0.0), np.where(ok, upper, np.inf), np.where(ok, se, np.inf))


def verdict_of(bounds: Mapping[str, tuple[np.ndarray | float, np.ndarray | float]], limits: Mapping[str, float],
               last: bool | np.ndarray = False) -> np.ndarray:
    """The verdict of (lower, upper) bounds per metric (arrays, one entry per run): ``fail`` where any lower bound
    is over its limit, else ``pass`` where every upper bound is within its limit, else ``continue`` (``undecided``
    where ``last``)."""
    outside = np.logical_or.reduce([np.asarray(bounds[m][0]) > limits[m] for m in limits])
    inside = np.logical_and.reduce([np.asarray(bounds[m][1]) <= limits[m] for m in limits])
    open_ = np.where(last, "undecided", "continue")
    return np.where(outside, "fail", np.where(inside, "pass", open_))


# ------------------------------------------------------------------------------------------------------ a look


@dataclass(frozen=True)
class Bound:
    """One metric at one look: its value, one-sided bounds (see :class:`Look` for their levels), its limit, and
    ``state``: ``inside`` (upper ≤ limit), ``outside`` (lower > limit) or ``open``. ``spread``: the mean's
    standard error over requests (NaN for a rate), which :func:`what_would_decide` scales; ``design_effect``: the
    rate's (:func:`design_effect`; 1 for a mean)."""

    metric: str
    value: float
    lower: float
    upper: float
    limit: float
    state: str
    spread: float = math.nan
    design_effect: float = 1.0


@dataclass(frozen=True)
class Look:
    """The verdict after look ``index``: ``requests`` and ``questions`` seen so far, their ``flips``, the
    ``level`` spent (each upper bound's; each lower bound's is ``lower_level``), a :class:`Bound` per gated metric,
    and ``verdict`` (``pass``, ``fail``, ``continue``; ``undecided`` at the last look)."""

    index: int
    requests: int
    questions: int
    flips: int
    level: float
    bounds: dict[str, Bound]
    verdict: str
    lower_level: float = math.nan
    alpha: float = ALPHA
    last: bool = False

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["bounds"] = {name: {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in asdict(b).items() if k != "metric"} for name, b in self.bounds.items()}
        return out


def _state(lower: float, upper: float, limit: float) -> str:
    return "outside" if lower > limit else "inside" if upper <= limit else "open"


def look(schedule: Schedule, k: int, kl: np.ndarray, flipped: np.ndarray, request_of: np.ndarray,
         limits: Mapping[str, float], *, seed: int = 0) -> Look:
    """The verdict at look ``k`` of ``schedule`` on every question seen so far (cumulative): ``kl`` and
    ``flipped`` per question, ``request_of`` each question's request index; ``limits`` maps the gated metrics
    (:data:`GATEABLE`) to their maximum. ``seed`` is accepted for a resampled bound and unused: the bounds here are
    analytic, the same for the same data. ValueError naming the bad input."""
    del seed  # the bounds are analytic (module docstring); kept so that a resampled bound can take its place
    bad = [m for m in limits if m not in GATEABLE]
    if bad or not limits:
        raise ValueError(f"gated metrics must be among {', '.join(GATEABLE)}, got {sorted(limits) or 'none'}")
    for name, limit in limits.items():
        if not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"the {name} limit must be a positive number, got {limit}")
    kl = np.asarray(kl, np.float64).reshape(-1)
    flipped = np.asarray(flipped).reshape(-1).astype(bool)
    request_of = np.asarray(request_of).reshape(-1)
    if not kl.size or kl.size != flipped.size or kl.size != request_of.size:
        raise ValueError(f"kl, flipped and request_of need one entry per question, the same number (≥ 1) each; got "
                         f"{kl.size}, {flipped.size}, {request_of.size}")
    if not np.all(np.isfinite(kl)) or np.any(kl < 0):
        raise ValueError("kl must be finite and ≥ 0 per question (clip tiny negative rounding to 0)")
    upper_level, lower_level = schedule.levels(k, len(limits))
    last = k == len(schedule.looks) - 1
    moments = RequestMoments.from_questions(kl, request_of)
    requests, questions, flips = int(moments.n), int(kl.size), int(flipped.sum())
    if requests != schedule.looks[k]:
        log.debug("look %d: %d requests seen, the schedule says %d", k, requests, schedule.looks[k])
    raw: dict[str, tuple[float, float, float, float]] = {}
    deff = 1.0
    if "flip_rate" in limits:
        deff = float(design_effect(RequestMoments.from_questions(flipped.astype(np.float64), request_of)))
        lo, up = flip_bounds(flips, questions, upper_level, lower_level, deff)
        raw["flip_rate"] = (flips / questions, float(lo), float(up), math.nan)
    if "mean_kl" in limits:
        lo, up, se = mean_bounds(moments, upper_level, lower_level)
        raw["mean_kl"] = (float(moments.mean), float(lo), float(up), float(se))
    bounds = {m: Bound(m, v, lo, up, float(limits[m]), _state(lo, up, float(limits[m])), se,
                       deff if m == "flip_rate" else 1.0) for m, (v, lo, up, se) in raw.items()}
    verdict = str(verdict_of({m: (b.lower, b.upper) for m, b in bounds.items()}, limits, last))
    log.info("verdict look %d (%d requests, %d questions, level %.4g): %s — %s", k, requests, questions,
             upper_level, verdict, ", ".join(f"{b.metric} {b.value:.4g} [{b.lower:.4g}, {b.upper:.4g}] {b.state}"
                                             for b in bounds.values()))
    return Look(k, requests, questions, flips, upper_level, bounds, verdict, lower_level, schedule.alpha, last)


# -------------------------------------------------------------------------------------------- what would decide


def _questions_to_decide(bound: Bound, side: str, upper_level: float, lower_level: float,
                         questions_now: int) -> float:
    """About how many questions at ``bound``'s observed value bring its ``side`` bound across the limit (inf if
    none do: the value is at the limit)."""
    value, limit = bound.value, bound.limit
    if bound.metric == "mean_kl":
        if not math.isfinite(bound.spread) or value == limit:
            return math.inf
        from scipy.stats import norm

        z = norm.ppf(1 - (upper_level if side == "upper" else lower_level))
        # the standard error shrinks as 1/√n: z·se·√(n_now/n) = |limit − value|
        return questions_now * (z * bound.spread / abs(limit - value)) ** 2

    def crosses(q: float) -> bool:
        lo, up = flip_bounds(value * q, q, upper_level, lower_level, bound.design_effect)
        return bool(up <= limit) if side == "upper" else bool(lo > limit)

    hi = 16.0
    while not crosses(hi):
        hi *= 2
        if hi > 1e8:
            return math.inf
    lo = hi / 2
    while hi - lo > 1:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if crosses(mid) else (mid, hi)
    return hi


def what_would_decide(last: Look) -> str:
    """One sentence for an undecided (or continuing) verdict: at the observed rates, about how many questions and
    requests would bring the open bounds inside (or one outside), and the flags that run them. The estimate
    assumes the new run's last look spends about half of ``alpha`` (as a doubling schedule's does)."""
    open_bounds = [b for b in last.bounds.values() if b.state == "open"]
    if last.verdict in ("pass", "fail") or not open_bounds:
        return f"the verdict is decided ({last.verdict}) after {last.requests} requests"
    per_request = last.questions / max(last.requests, 1)
    metrics = len(last.bounds)
    upper_level, lower_level = last.alpha / 2, last.alpha / 2 / metrics
    over = [b for b in open_bounds if b.value > b.limit]
    # a fail needs one lower bound outside (the nearest will do); a pass needs every upper bound inside
    candidates = over or open_bounds
    need = [(_questions_to_decide(b, "lower" if over else "upper", upper_level, lower_level, last.questions), b)
            for b in candidates]
    questions, bound = (min if over else max)(need, key=lambda pair: pair[0])
    direction = "over" if over else "within"
    shown = f"{bound.metric} {bound.value:.4g} (bounds [{bound.lower:.4g}, {bound.upper:.4g}], limit {bound.limit:g})"
    if not math.isfinite(questions):
        return (f"undecided after {last.requests} requests: {shown} sits at its limit, so no number of requests at "
                f"this rate decides it; the variant is as far from its limit as it can be measured")
    requests = max(math.ceil(questions / per_request / 8.0) * 8, last.requests + 8)
    return (f"undecided after {last.requests} requests: at the observed rate, about {math.ceil(questions):,} "
            f"questions (~{requests:,} requests) would show {shown} {direction} its limit: --validation-requests "
            f"{requests} or --validation-data FILE with more requests")
