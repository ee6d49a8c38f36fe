"""Reference against a variant: one request side by side, and a small built-in drift probe with an HTML report.

The metrics are :mod:`clef_local.quality.drift`'s (imported lazily); this module only arranges what the page shows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_local.app.schema_builder import example_request

# Other states for each built-in example, so the probe covers a few inputs per schema (offline, no dataset).
_PROBE_STATES: dict[str, list[Any]] = {
    "triage": [
        "I can't log in since I changed my phone number. Please help me get into my account.",
        "My transfer to my sister has been pending for three days, where is the money?",
        "Just wanted to say the new app design looks great, thanks!",
    ],
    "moderation": [
        {"author": "user_77", "text": "Great write-up, I learned a lot from this thread."},
        {"author": "user_9", "text": "People like you should not be allowed to post anything, idiots."},
        {"author": "user_301", "text": "Buy cheap followers now!!! Click my profile link."},
    ],
    "routing": [
        "Find me the opening hours of the city library.",
        "Email my team that the standup moves to 10am and put it in my calendar.",
        "Book two train tickets to Lyon for Friday morning.",
    ],
}


def probe_requests() -> list[dict[str, Any]]:
    """The built-in probe: each example request with its own state and three others (12 requests)."""
    out: list[dict[str, Any]] = []
    for name, states in _PROBE_STATES.items():
        base = example_request(name)
        out.append(base)
        out.extend({**base, "state": state} for state in states)
    return out


@dataclass(frozen=True)
class Comparison:
    """One request through both models: the two responses and each question's drift (by question id)."""

    reference: dict[str, Any]
    variant: dict[str, Any]
    drifts: dict[str, Any]  # question id → clef_local.quality.drift.QuestionDrift
    reference_seconds: float
    variant_seconds: float


def compare_request(reference: Any, variant: Any, request: dict[str, Any]) -> Comparison:
    """Run ``request`` through both loaded models and compare them question by question."""
    import time

    from clef_local.quality.drift import compare_predictions

    started = time.perf_counter()
    ref_pred = reference.predict([request])[0]
    ref_seconds = time.perf_counter() - started
    var_pred = variant.predict([request])[0]
    var_seconds = time.perf_counter() - started - ref_seconds
    drifts = {d.question_id: d for d in compare_predictions([ref_pred], [var_pred])}
    return Comparison(ref_pred.response(reference.confidence), var_pred.response(variant.confidence), drifts,
                      ref_seconds, var_seconds)


def run_probe(reference: Any, variant: Any, progress: Callable[[int, int], None] | None = None,
              out_dir: Path | None = None) -> tuple[dict[str, Any], Path]:
    """Run the built-in probe through both models; return the drift summary and the HTML report's path."""
    from clef_local.quality.drift import run_drift
    from clef_local.quality.report import write_report

    result = run_drift(reference, variant, probe_requests(), progress=progress)
    directory = out_dir or Path(tempfile.mkdtemp(prefix="clef-ui-drift-"))
    html = write_report([result], directory / "drift-report.html",
                        title=f"clef-local drift probe: {Path(str(variant.path)).name} vs "
                              f"{Path(str(reference.path)).name}")
    return result.summary, html


def probe_markdown(summary: dict[str, Any], report: Path) -> str:
    """A short summary of the probe for the page."""
    def fmt(key: str, spec: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, spec)

    return (f"**Drift probe** over {summary.get('questions', 0)} questions: mean KL {fmt('kl_mean', '.2e')}, "
            f"max KL {fmt('kl_max', '.2e')}, largest |Δp| {fmt('max_abs_max', '.4f')}, "
            f"flips {summary.get('flips', 0)} ({fmt('flip_rate', '.1%')}). "
            f"Report: `{report}` (download below).")
