"""The report's plots as base64 PNG strings (matplotlib, Agg backend, imported only when a plot is drawn), ready for
``<img src="data:...">``: reliability diagrams, a histogram of per-question KL, reference against candidate
probabilities, confidence–accuracy curves (accuracy of the questions answered at or above each threshold), probe
checks and risk–coverage curves.
"""

from __future__ import annotations

import base64
import importlib.util
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from clef_local.quality.metrics import reliability_bins

Series = tuple[str, np.ndarray, np.ndarray]  # name, confidence (or x), correct (or y)
_COLORS = ("#1f3b73", "#d1495b", "#edae49", "#00798c", "#66a182", "#8d6a9f", "#30638e", "#a05c34")
_SCATTER_POINTS = 20_000
REPORT_EXTRA = "pip install 'clef-local[report]'"


def require_matplotlib() -> None:
    """Raise ``ModuleNotFoundError`` naming the extra when matplotlib is missing. Commands that write an HTML report
    call it before they load a model, so a missing extra costs a second, not the whole run."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(f"matplotlib is not installed (HTML reports draw plots with it): {REPORT_EXTRA}",
                                  name="matplotlib")


def _figure(width: float = 5.0, height: float = 3.6) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    return fig, ax


def _encode(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def reliability_png(title: str, series: Sequence[Series], bins: int = 15) -> str:
    """Accuracy against mean confidence per bin, one line per series; the diagonal is perfect calibration."""
    fig, ax = _figure()
    ax.plot([0, 1], [0, 1], color="#999999", linestyle="--", linewidth=1, label="perfect")
    for n, (name, confidence, correct) in enumerate(series):
        points = reliability_bins(confidence, correct, bins)
        if points:
            x, y, counts = zip(*points, strict=True)
            sizes = 12 + 60 * np.asarray(counts) / max(counts)
            ax.plot(x, y, color=_COLORS[n % len(_COLORS)], linewidth=1.5, label=name)
            ax.scatter(x, y, s=sizes, color=_COLORS[n % len(_COLORS)], alpha=0.7)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (top-class probability)", ylabel="accuracy", title=title)
    ax.legend(fontsize=7, loc="upper left")
    return _encode(fig)


def kl_histogram_png(series: Sequence[tuple[str, np.ndarray]]) -> str:
    """Histogram of per-question KL(ref ‖ cand) on a log axis, one outline per candidate."""
    fig, ax = _figure()
    values = [np.clip(np.asarray(kl, float), 1e-8, None) for _, kl in series]
    top = max((v.max() for v in values if v.size), default=1.0)
    edges = np.logspace(-8, np.log10(max(top, 1e-7)) + 0.1, 40)
    for n, ((name, _), v) in enumerate(zip(series, values, strict=True)):
        ax.hist(v, bins=edges, histtype="step", linewidth=1.5, color=_COLORS[(n + 1) % len(_COLORS)], label=name)
    ax.set(xscale="log", xlabel="KL(reference ‖ candidate), nats (≤1e-8 shown at 1e-8)", ylabel="questions",
           title="per-question KL")
    ax.legend(fontsize=7)
    return _encode(fig)


def scatter_png(series: Sequence[Series]) -> str:
    """Every option's probability, reference (x) against candidate (y); points off the diagonal moved."""
    fig, ax = _figure()
    ax.plot([0, 1], [0, 1], color="#999999", linestyle="--", linewidth=1)
    rng = np.random.default_rng(0)
    for n, (name, x, y) in enumerate(series):
        x, y = np.asarray(x, float), np.asarray(y, float)
        if x.size > _SCATTER_POINTS:  # keep the image light; the sample is fixed by the seed
            keep = rng.choice(x.size, _SCATTER_POINTS, replace=False)
            x, y = x[keep], y[keep]
        ax.scatter(x, y, s=4, alpha=0.35, color=_COLORS[(n + 1) % len(_COLORS)], label=name)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="p reference", ylabel="p candidate", title="option probabilities")
    ax.legend(fontsize=7, markerscale=3)
    return _encode(fig)


def confidence_accuracy_png(title: str, series: Sequence[Series]) -> str:
    """Accuracy of the questions whose confidence is ≥ t, against the share of questions kept, for every t."""
    fig, ax = _figure()
    for n, (name, confidence, correct) in enumerate(series):
        confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
        if not confidence.size:
            continue
        order = np.argsort(-confidence, kind="stable")
        kept = np.arange(1, confidence.size + 1)
        ax.plot(kept / confidence.size, np.cumsum(correct[order]) / kept, color=_COLORS[n % len(_COLORS)],
                linewidth=1.5, label=name)
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="share of questions answered (most confident first)",
           ylabel="accuracy of those answered", title=title)
    ax.legend(fontsize=7, loc="lower left")
    return _encode(fig)


def probe_png(result: Any) -> str:
    """A :class:`~clef_local.quality.results.ProbeResult`: each check's mean |Δp| (bars, with the interval as error
    bars) and flipped share (points, right axis, with the exact interval)."""
    fig, ax = _figure(6.4, 3.6)
    checks = [c for c, v in result.checks.items() if v.get("questions")]
    x = np.arange(len(checks))

    def spans(metric: str) -> tuple[np.ndarray, np.ndarray]:
        values = np.array([result.checks[c][metric] for c in checks], dtype=float)
        iv = np.array([result.checks[c]["intervals"].get(metric) or [v, v] for c, v in zip(checks, values,
                                                                                            strict=True)], dtype=float)
        return values, np.abs(np.stack([values - iv[:, 0], iv[:, 1] - values]))

    if checks:
        dp, dp_err = spans("mean_abs_dp")
        ax.bar(x - 0.18, dp, width=0.36, color=_COLORS[0], yerr=dp_err, capsize=3, label="mean |Δp|")
        flips, flip_err = spans("flip_rate")
        right = ax.twinx()
        right.errorbar(x + 0.18, flips, yerr=flip_err, fmt="o", color=_COLORS[1], capsize=3, label="flipped")
        right.set_ylabel("flipped decisions", color=_COLORS[1])
        right.set_ylim(0, max(0.05, float(np.nanmax(flips + flip_err[1])) * 1.15))
    ax.set_xticks(x, [c.replace("_", "\n") for c in checks], fontsize=7)
    ax.set(ylabel="mean |Δp| (largest option move per question)", title="probe: answers under rewrites")
    ax.set_ylim(0, None)
    fig.legend(fontsize=7, loc="upper right")
    return _encode(fig)


def risk_coverage_png(title: str, budget: Any) -> str:
    """``eval --error-budget``'s risk-coverage curves per type (error among the answered questions against the share
    answered), the budget as a line and each chosen threshold as a point."""
    fig, ax = _figure()
    for n, (kind, entry) in enumerate(budget["types"].items()):
        curve = np.asarray(entry["curve"], dtype=float).reshape(-1, 2)
        color = _COLORS[n % len(_COLORS)]
        if curve.size:
            ax.plot(curve[:, 0], curve[:, 1], color=color, linewidth=1.5, label=kind)
        if entry.get("threshold") is not None:
            ax.scatter([entry["coverage"]], [entry["error"]], color=color, s=40, zorder=3,
                       label=f"{kind}: t={entry['threshold']:.3f}")
    ax.axhline(budget["budget"], color="#999999", linestyle="--", linewidth=1, label=f"budget {budget['budget']:g}")
    ax.set(xlim=(0, 1), ylim=(0, None), xlabel="coverage (share of questions answered)",
           ylabel="error among the answered", title=title)
    ax.legend(fontsize=7, loc="upper left")
    return _encode(fig)
