"""The result types of the quality commands, shared by drift, eval, calibrate, report and the UI.

``DriftResult`` and ``EvalResult`` round-trip through JSON (``to_json`` / ``from_json``), which is what
``clef-local report`` re-renders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Progress = Callable[[int, int], None]  # progress(done, total), called after each batch


@dataclass(frozen=True)
class QuestionDrift:
    """One question's candidate distribution against the reference's."""

    kind: str
    kl: float
    js: float
    max_abs: float
    rms: float
    flipped: bool
    score_shift: float | None = None
    question_id: str = ""
    request_index: int = -1


def gold_index(option_ids: Sequence[str], label: Any) -> int:
    """The model-order index of a label (``True``/``False`` for noul, an option id for choice, a level for score)."""
    key = ("true" if label else "false") if isinstance(label, bool) else str(label)
    try:
        return list(option_ids).index(key)
    except ValueError:
        raise ValueError(f"label {label!r} is not one of the question's options {list(option_ids)[:8]}…; "
                         "fix the labels or the question's criteria") from None


@dataclass
class QuestionRow:
    """One question as the report needs it: both distributions, the drift, the gold index (None: unlabelled)."""

    request_index: int
    question_id: str
    kind: str
    options: list[str]
    p_ref: list[float]
    p_cand: list[float]
    drift: QuestionDrift
    gold: int | None = None
    state: str = ""


@dataclass
class DriftResult:
    """One candidate against the reference: summary overall and per type, labelled metrics, every question."""

    reference: str
    candidate: str
    summary: dict[str, Any]
    by_type: dict[str, dict[str, Any]]
    rows: list[QuestionRow]
    labelled: dict[str, dict[str, Any]] = field(default_factory=dict)  # type → {reference, candidate, delta, …}
    timing: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # network state, dtypes, data source, …
    # type (and "all") → {metric: [low, high]} at meta["intervals"]["confidence"] (quality/intervals.py)
    intervals: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)

    def worst(self, n: int = 10) -> list[QuestionRow]:
        """The ``n`` questions with the largest KL (flips first when KL ties)."""
        return sorted(self.rows, key=lambda r: (r.drift.kl, r.drift.flipped), reverse=True)[:n]

    def to_json(self) -> dict[str, Any]:
        return {"format": "clef-local-drift/1", "reference": self.reference, "candidate": self.candidate,
                "summary": self.summary, "by_type": self.by_type, "labelled": self.labelled,
                "timing": self.timing, "meta": self.meta, "intervals": self.intervals,
                "rows": [{**{k: v for k, v in asdict(r).items() if k != "drift"}, "drift": asdict(r.drift)}
                         for r in self.rows]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DriftResult:
        if data.get("format") != "clef-local-drift/1":
            raise ValueError(f"not a clef-local drift JSON (format {data.get('format')!r}); write one with "
                             "`clef-local drift --json`")
        rows = [QuestionRow(**{**r, "drift": QuestionDrift(**r["drift"])}) for r in data["rows"]]
        return cls(reference=data["reference"], candidate=data["candidate"], summary=data["summary"],
                   by_type=data["by_type"], rows=rows, labelled=data.get("labelled", {}),
                   timing=data.get("timing", {}), meta=data.get("meta", {}),
                   intervals=data.get("intervals", {}))


@dataclass
class EvalRow:
    """One labelled question: its type, option ids, probabilities (model order), gold index and request (the unit
    the bootstrap resamples; -1 in results saved before it was recorded: each question then counts alone)."""

    kind: str
    options: list[str]
    probs: list[float]
    gold: int
    request: int = -1


@dataclass
class EvalResult:
    """Metrics of one model on one data set: per type, latency and throughput, and the rows behind them."""

    model: str
    data: str
    requests: int
    questions: int
    metrics: dict[str, dict[str, float]]  # type (and "all") → labelled_report
    speed: dict[str, float]
    rows: list[EvalRow] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    # type (and "all") → {metric: [low, high]}: bootstrap over requests, error_rate exact binomial
    intervals: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    selective: dict[str, Any] = field(default_factory=dict)  # --error-budget (quality/selective.py), stored thresholds

    def to_json(self) -> dict[str, Any]:
        return {"format": "clef-local-eval/1", **{k: v for k, v in asdict(self).items() if k != "rows"},
                "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalResult:
        if data.get("format") != "clef-local-eval/1":
            raise ValueError(f"not a clef-local eval JSON (format {data.get('format')!r}); write one with "
                             "`clef-local eval --json`")
        fields = {k: v for k, v in data.items() if k not in ("format", "rows")}
        return cls(**fields, rows=[EvalRow(**r) for r in data.get("rows", [])])


@dataclass
class ProbeResult:
    """``clef-local probe``: each metamorphic check's effect on one model's answers (quality/probe.py).

    ``checks`` maps a check to ``{description, requests, questions, mean_abs_dp, kl_mean, max_abs_dp, flips,
    flip_rate}`` with ``[low, high]`` intervals under ``intervals``; ``worst`` a check's largest moves.
    """

    model: str
    data: str
    requests: int
    checks: dict[str, dict[str, Any]]
    worst: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": "clef-local-probe/1", **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeResult:
        if data.get("format") != "clef-local-probe/1":
            raise ValueError(f"not a clef-local probe JSON (format {data.get('format')!r}); write one with "
                             "`clef-local probe --json`")
        return cls(**{k: v for k, v in data.items() if k != "format"})
