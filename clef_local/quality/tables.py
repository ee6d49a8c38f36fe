"""The report's cells and the tables of the figures that carry intervals: values as ``value [low, high]``, the
comparison of candidates (:mod:`.compare`), selective prediction (:mod:`.selective`) and probe checks
(:mod:`.probe`). Each function returns a header row plus rows of strings, for Markdown or HTML alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clef_local.quality.results import EvalResult, ProbeResult


def fmt(value: Any, spec: str = "g") -> str:
    """A number as the report shows it (``—`` for a missing or non-finite one); ``spec`` ``d``, ``g`` or a format."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if spec == "d":
        return str(int(value))
    if spec == "g":
        return f"{value:.4g}"
    return format(value, spec)


def cell(value: Any, interval: Sequence[Any] | None = None, spec: str = "g") -> str:
    """``value [low, high]``, or the value alone when there is no interval."""
    text = fmt(value, spec)
    if text != "—" and interval and len(interval) == 2 and None not in interval:
        text += f" [{fmt(interval[0], spec)}, {fmt(interval[1], spec)}]"
    return text


def name(path: str) -> str:
    return Path(path).name or path


def _p(value: Any) -> str:
    return "—" if value is None else f"{value:.3g}"


def comparison_table_rows(comparison: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """One row per pair of candidates: flips (McNemar), mean KL (paired bootstrap), correct answers (McNemar)."""
    rows = [["A vs B", "flip rate A / B", "p (flips, McNemar)", "KL mean A / B", "ΔKL B−A [interval]",
             "p (KL, bootstrap)", "accuracy A / B", "p (correct, McNemar)", "verdict"]]
    for c in comparison:
        kl = c["kl"]
        accuracy = c.get("accuracy")
        rows.append([f"{name(c['a'])} vs {name(c['b'])}",
                     f"{fmt(c['flip_rate'][0], '.2%')} / {fmt(c['flip_rate'][1], '.2%')}", _p(c["flips"]["p_value"]),
                     f"{fmt(c['kl_mean'][0])} / {fmt(c['kl_mean'][1])}", cell(kl["difference"], kl["interval"]),
                     _p(kl["p_value"]),
                     "—" if accuracy is None else f"{fmt(accuracy[0], '.4f')} / {fmt(accuracy[1], '.4f')}",
                     _p(c["correct"]["p_value"]) if "correct" in c else "—", c["verdict"]])
    return rows


def selective_table_rows(result: EvalResult) -> list[list[str]]:
    """``--error-budget``'s thresholds per type, then the coverage and error at the model's stored thresholds."""
    rows = [["", "type", "threshold", "coverage", "answered / n", "error [interval]", "chosen on"]]
    budget = result.selective.get("budget")
    if budget:
        level = budget["confidence"]
        for kind, t in budget["types"].items():
            chosen = (f"exact upper bound {fmt(t['error_bound'], '.4f')} ≤ {budget['budget']:g} (one-sided "
                      f"{fmt(t['bound_level'], '.4f')}, {t['tested']} thresholds tried)" if budget["bound"] == "upper"
                      else f"observed error ≤ {budget['budget']:g}")
            rows.append([f"budget {budget['budget']:g}", kind, fmt(t["threshold"], ".4f"), fmt(t["coverage"], ".1%"),
                         f"{t['covered']} / {t['n']}", cell(t["error"], t["error_interval"], ".2%"),
                         chosen if t["threshold"] is not None else f"none keeps the error ≤ {budget['budget']:g} "
                         f"at {level:.0%}: abstain"])
    stored = result.selective.get("stored")
    if stored:
        for kind, t in stored["types"].items():
            rows.append(["stored thresholds", kind, fmt(t["threshold"], ".4f"), fmt(t["coverage"], ".1%"),
                         f"{t['covered']} / {t['n']}", cell(t["error"], t["error_interval"], ".2%"),
                         "calibrate --error-budget"])
    return rows


def probe_table_rows(result: ProbeResult) -> list[list[str]]:
    """One row per check: what it changes, requests and questions it changed, mean |Δp|, KL and flips with their
    intervals, the largest |Δp|."""
    rows = [["check", "what changes", "requests", "questions", "mean |Δp| [interval]", "KL mean [interval]",
             "flipped [interval]", "flips", "max |Δp|"]]
    for check, c in result.checks.items():
        iv = c.get("intervals", {})
        rows.append([check, c["description"], str(c["requests"]), str(c["questions"]),
                     cell(c["mean_abs_dp"], iv.get("mean_abs_dp"), ".4f"), cell(c["kl_mean"], iv.get("kl_mean")),
                     cell(c["flip_rate"], iv.get("flip_rate"), ".2%"), str(c["flips"]),
                     fmt(c["max_abs_dp"], ".4f")])
    return rows
