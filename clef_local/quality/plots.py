"""The report's plots as base64 PNG strings (matplotlib, Agg backend, imported only when a plot is drawn), ready for
``<img src="data:...">``: reliability diagrams, a histogram of per-question KL, reference against candidate
probabilities, and confidence–accuracy curves (accuracy of the questions answered at or above each threshold).
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
