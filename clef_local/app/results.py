"""Results as the page shows them: per-question probability bars (HTML, sorted), a summary table, compare views.

Plain HTML with inline styles (no plotting library): the bars are real elements the browser test can find
(``.clef-bar`` with ``data-p``), and nothing heavy is imported to draw them.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

SUMMARY_HEADERS = ["question", "type", "decision", "confidence", "p(decision)", "expected score"]
COMPARE_HEADERS = ["question", "type", "reference", "variant", "flipped", "max |Δp|", "RMS Δp", "KL(ref‖var)",
                   "JS"]
_REF_COLOR = "#2563eb"
_VAR_COLOR = "#f97316"
_FLIP_COLOR = "#dc2626"


@dataclass(frozen=True)
class QuestionView:
    """One answered question: its options with probabilities (request order) and its decision."""

    qid: str
    kind: str
    options: list[tuple[str, float]]
    decision: str
    confidence: float | None
    expected_score: float | None

    @property
    def sorted_options(self) -> list[tuple[str, float]]:
        return sorted(self.options, key=lambda item: item[1], reverse=True)

    @property
    def p_decision(self) -> float:
        return dict(self.options)[self.decision]


def question_views(response: dict[str, Any]) -> list[QuestionView]:
    """The response's answers as views, in request order."""
    views = []
    for qid, answer in response["answers"].items():
        kind = answer["type"]
        if kind == "noul":
            p_true = float(answer["noul"])
            options = [("true", p_true), ("false", 1.0 - p_true)]
            views.append(QuestionView(qid, kind, options, "true" if p_true >= 0.5 else "false", None, None))
            continue
        options = [(label, float(p)) for label, p in answer["probabilities"].items()]
        if kind == "choice":
            decision = answer["choice"]
            score = None
        else:
            decision = max(options, key=lambda item: item[1])[0]  # the mode level; the score is the mean
            score = float(answer["score"])
        views.append(QuestionView(qid, kind, options, decision, float(answer["confidence"]), score))
    return views


def summary_rows(views: list[QuestionView]) -> list[list[Any]]:
    """Rows for :data:`SUMMARY_HEADERS`."""
    rows = []
    for v in views:
        rows.append([v.qid, v.kind, v.decision, _num(v.confidence), round(v.p_decision, 4), _num(v.expected_score)])
    return rows


def _num(value: float | None) -> float | str:
    return "" if value is None else round(value, 4)


def _option_label(view: QuestionView, option: str, legend: dict[str, Any] | None) -> str:
    if view.kind == "score" and legend and option in legend:
        return f"{option} · {legend[option]}"
    return option


def _head(view: QuestionView, extra: str = "", legend: dict[str, Any] | None = None) -> str:
    parts = [f'<b style="font-size:1.05em">{escape(view.qid)}</b>',
             f'<span style="opacity:.7">{view.kind}</span>',
             f'decision <b class="clef-decision">{escape(_option_label(view, view.decision, legend))}</b>']
    if view.confidence is not None:
        parts.append(f'confidence <b class="clef-confidence">{view.confidence:.4f}</b>')
    if view.expected_score is not None:
        parts.append(f'expected score <b class="clef-score">{view.expected_score:.3f}</b>')
    return f'<div style="display:flex;gap:1em;flex-wrap:wrap;align-items:baseline">{" ".join(parts)}{extra}</div>'


def _bar(p: float, color: str, css_class: str, outline: bool = False) -> str:
    width = max(0.0, min(1.0, p)) * 100
    fill = f"border:2px solid {color};background:transparent" if outline else f"background:{color};opacity:.85"
    return (f'<div class="{css_class}" data-p="{p:.6f}" style="position:absolute;left:0;top:0;bottom:0;'
            f'width:{width:.2f}%;{fill};border-radius:3px"></div>')


def _row(label: str, bars: str, numbers: str) -> str:
    return ('<div class="clef-row" style="display:grid;grid-template-columns:minmax(6em,16em) 1fr 9em;gap:.6em;'
            'align-items:center;margin:2px 0">'
            f'<span class="clef-label" style="overflow:hidden;text-overflow:ellipsis;white-space:nowrap" '
            f'title="{escape(label)}">{escape(label)}</span>'
            '<div style="position:relative;height:1.1em;background:rgba(127,127,127,.15);border-radius:3px">'
            f'{bars}</div><span class="clef-p" style="font-variant-numeric:tabular-nums">{numbers}</span></div>')


def results_html(response: dict[str, Any]) -> str:
    """Per question: a bar per option sorted by probability, with the decision, confidence and expected score."""
    cards = []
    for view in question_views(response):
        legend = response["answers"][view.qid].get("legend")
        rows = "".join(_row(_option_label(view, option, legend), _bar(p, _REF_COLOR, "clef-bar"), f"{p:.4f}")
                       for option, p in view.sorted_options)
        cards.append(f'<div class="clef-question" data-qid="{escape(view.qid)}" style="margin:0 0 1em 0">'
                     f'{_head(view, legend=legend)}{rows}</div>')
    return f'<div class="clef-results">{"".join(cards)}</div>'


def compare_html(reference: dict[str, Any], variant: dict[str, Any], drifts: dict[str, Any],
                 names: tuple[str, str] = ("reference", "variant")) -> str:
    """Overlaid bars (reference filled, variant outlined) per question; flipped decisions in red."""
    legend_html = (f'<div style="margin-bottom:.5em"><span style="color:{_REF_COLOR}">■ {escape(names[0])}</span>'
                   f' &nbsp; <span style="color:{_VAR_COLOR}">□ {escape(names[1])}</span></div>')
    var_views = {v.qid: v for v in question_views(variant)}
    cards = []
    for ref in question_views(reference):
        var = var_views[ref.qid]
        var_p = dict(var.options)
        drift = drifts[ref.qid]
        flipped = bool(drift.flipped)
        badge = (f' <b class="clef-flip" style="color:{_FLIP_COLOR}">flipped: {escape(ref.decision)} → '
                 f'{escape(var.decision)}</b>') if flipped else ""
        stats = (f' <span class="clef-drift" style="opacity:.8">max |Δp| {drift.max_abs:.4f} · '
                 f'KL {drift.kl:.2e}</span>')
        legend = reference["answers"][ref.qid].get("legend")
        rows = []
        for option, p in ref.sorted_options:
            q = var_p[option]
            bars = _bar(p, _REF_COLOR, "clef-bar clef-bar-ref") + _bar(q, _VAR_COLOR, "clef-bar clef-bar-var", True)
            rows.append(_row(_option_label(ref, option, legend), bars, f"{p:.4f} → {q:.4f}"))
        border = f"border-left:4px solid {_FLIP_COLOR};padding-left:.6em;" if flipped else ""
        cards.append(f'<div class="clef-compare-question{" clef-flipped" if flipped else ""}" '
                     f'data-qid="{escape(ref.qid)}" style="{border}margin:0 0 1em 0">'
                     f'{_head(ref, stats + badge, legend)}{"".join(rows)}</div>')
    return f'<div class="clef-compare">{legend_html}{"".join(cards)}</div>'


def compare_rows(reference: dict[str, Any], variant: dict[str, Any], drifts: dict[str, Any]) -> list[list[Any]]:
    """Rows for :data:`COMPARE_HEADERS` (one per question, request order)."""
    var_views = {v.qid: v for v in question_views(variant)}
    rows = []
    for ref in question_views(reference):
        d = drifts[ref.qid]
        rows.append([ref.qid, ref.kind, ref.decision, var_views[ref.qid].decision, "FLIPPED" if d.flipped else "",
                     d.max_abs, d.rms, d.kl, d.js])
    return rows
