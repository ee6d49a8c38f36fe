"""Drift / eval / calibration / probe reports: one self-contained HTML file (plots embedded as PNG), Markdown, JSON.

:func:`write_report` puts any number of candidates' drift against one reference in one table (the noise floor
beside them) — after the table that compares the candidates with each other when there are several —, with evals,
calibrations and probe checks, every figure as ``value [low, high]`` where it has an interval, and states the runs'
network state at the top (:func:`network_field` names every value when they differ). ``clef-local report``
re-renders saved JSON. docs/quality.md#report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.quality.results import DriftResult, EvalResult, ProbeResult
from clef_local.quality.tables import cell, comparison_table_rows, probe_table_rows, selective_table_rows
from clef_local.quality.tables import fmt as _fmt
from clef_local.quality.tables import name as _name
from clef_local.runtime.schema import QUESTION_TYPES

__all__ = ["comparison_table_rows", "drift_table_rows", "labelled_table_rows", "markdown_table", "probe_table_rows",
           "render_html", "render_markdown", "render_validation_html", "selective_table_rows", "write_report"]

BUNDLE = "clef-local-report/1"
DRIFT_COLUMNS = (("questions", "questions", "d"), ("kl_mean", "KL mean", "g"), ("kl_p99", "KL p99", "g"),
                 ("kl_max", "KL max", "g"), ("js_mean", "JS mean", "g"), ("max_abs_mean", "mean |Δp|", ".4f"),
                 ("max_abs_max", "max |Δp|", ".4f"),
                 ("rms_mean", "RMS Δp", ".4f"), ("flip_rate", "flip rate", ".2%"), ("flips", "flips", "d"),
                 ("score_shift_mean_abs", "|score shift|", ".4f"))
LABEL_METRICS = ("accuracy", "macro_f1", "nll", "brier", "ece", "adaptive_ece")
CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#1d1d1f;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 20px;font-size:13px}th,td{border:1px solid #ccd;padding:3px 8px}
th{background:#eef1f7}td.n{text-align:right;font-variant-numeric:tabular-nums}.floor{color:#666;font-style:italic}
.fail{color:#b00020;font-weight:600}.ok{color:#1b7a3a}img{max-width:49%;border:1px solid #eee;margin:2px}
.net{display:inline-block;padding:2px 8px;border-radius:4px;background:#e4f4e8}.small{font-size:12px;color:#555}
.net.on{background:#fbe4e4}code{background:#f3f3f3;padding:1px 3px}"""


def drift_table_rows(results: Sequence[DriftResult], floor: DriftResult | None = None) -> list[list[str]]:
    """Header plus one row per candidate (and the noise floor last): the overall drift summary, each mean and the
    flip rate with its interval."""
    rows = [["candidate", *[label for _, label, _ in DRIFT_COLUMNS]]]
    for result, is_floor in [*((r, False) for r in results), *([(floor, True)] if floor else [])]:
        label = f"noise floor: {result.candidate}" if is_floor else _name(result.candidate)
        iv = result.intervals.get("all", {})
        rows.append([label, *[cell(result.summary.get(key), iv.get(key), spec) for key, _, spec in DRIFT_COLUMNS]])
    return rows


def labelled_table_rows(results: Sequence[DriftResult]) -> list[list[str]]:
    """Per type: the reference's labelled metrics, then each candidate's value and delta (with their intervals:
    the delta's is paired), and the error rates' exact bounds with McNemar's test of the two models' errors."""
    rows = [["type", "metric", "reference", *[f"{_name(r.candidate)} (Δ)" for r in results]]]
    if not results:
        return rows
    for kind in (*QUESTION_TYPES, "all"):
        first = results[0].labelled.get(kind)
        if not first:
            continue
        ref_iv = first.get("intervals", {}).get("reference", {})
        for metric in LABEL_METRICS:
            cells = [kind, metric, cell(first["reference"][metric], ref_iv.get(metric), ".4f")]
            for r in results:
                entry = r.labelled.get(kind)
                iv = (entry or {}).get("intervals", {})
                cells.append("—" if not entry else
                             f"{cell(entry['candidate'][metric], iv.get('candidate', {}).get(metric), '.4f')} "
                             f"(Δ {cell(entry['delta'][metric], iv.get('delta', {}).get(metric), '+.4f')})")
            rows.append(cells)
        if "intervals" in first:
            ref_error = 1 - first["reference"]["accuracy"]
            cells = [kind, "error rate (McNemar p)",
                     cell(ref_error, first["intervals"]["error_rate"]["reference"], ".2%")]
            for r in results:
                entry = r.labelled.get(kind) or {}
                if "intervals" not in entry:
                    cells.append("—")
                    continue
                error = cell(1 - entry["candidate"]["accuracy"], entry["intervals"]["error_rate"]["candidate"], ".2%")
                cells.append(f"{error} (p={entry['mcnemar']['p_value']:.3g})")
            rows.append(cells)
    return rows


def eval_table_rows(evals: Sequence[EvalResult]) -> list[list[str]]:
    """Per model and type: the labelled metrics with their intervals, and the error rate's exact bounds."""
    rows = [["model", "type", "n", *LABEL_METRICS, "error rate"]]
    for e in evals:
        for kind, m in e.metrics.items():
            iv = e.intervals.get(kind, {})
            rows.append([_name(e.model), kind, str(m["n"]), *[cell(m[k], iv.get(k), ".4f") for k in LABEL_METRICS],
                         cell(1 - m["accuracy"], iv.get("error_rate"), ".2%")])
    return rows


def speed_table_rows(evals: Sequence[EvalResult]) -> list[list[str]]:
    rows = [["model", "batch", "requests", "req/s", "tok/s", "ms/request", "batch p50 ms", "batch p90 ms"]]
    for e in evals:
        s = e.speed
        rows.append([_name(e.model), _fmt(s["batch_size"], "d"), str(e.requests), _fmt(s["requests_per_s"], ".3f"),
                     _fmt(s["tokens_per_s"], ".0f"), _fmt(s["ms_per_request"], ".1f"), _fmt(s.get("p50_ms"), ".0f"),
                     _fmt(s.get("p90_ms"), ".0f")])
    return rows


def calibration_table_rows(calibration: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    rows = [["model", "fit", "measured on", "type", "T", "n", "ECE before", "ECE after", "NLL before", "NLL after"]]
    for c in calibration:
        for kind, entry in c["types"].items():
            before, after = entry.get("before") or {}, entry.get("after") or {}
            rows.append([_name(c["model"]), c["objective"], c.get("measured_on", ""), kind,
                         _fmt(entry["temperature"], ".3f") + ("" if entry.get("fitted", True) else " (not fitted)"),
                         _fmt(before.get("n"), "d"), _fmt(before.get("ece"), ".4f"),
                         _fmt(after.get("ece"), ".4f"), _fmt(before.get("nll"), ".4f"), _fmt(after.get("nll"), ".4f")])
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """GitHub Markdown for a header + rows table."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [line(rows[0]), "|" + "---|" * len(rows[0]), *(line(r) for r in rows[1:])]
    return "\n".join(lines)


def _html_table(rows: Sequence[Sequence[str]], floor_last: bool = False) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = []
    for n, row in enumerate(rows[1:], start=1):
        cls = ' class="floor"' if floor_last and n == len(rows) - 1 else ""
        cells = "".join(f'<td class="n">{html.escape(c)}</td>' if i else f"<td>{html.escape(c)}</td>"
                        for i, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _conf_correct(probs: Sequence[Sequence[float]], gold: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    conf = np.array([max(p) for p in probs], dtype=float)
    correct = np.array([int(np.argmax(p)) == g for p, g in zip(probs, gold, strict=True)], dtype=float)
    return conf, correct


def _drift_plots(results: Sequence[DriftResult]) -> list[tuple[str, str]]:
    from clef_local.quality import plots

    images = [("per-question KL", plots.kl_histogram_png([(_name(r.candidate), np.array([q.drift.kl for q in r.rows]))
                                                          for r in results])),
              ("p reference vs p candidate", plots.scatter_png(
                  [(_name(r.candidate), np.concatenate([q.p_ref for q in r.rows]),
                    np.concatenate([q.p_cand for q in r.rows])) for r in results if r.rows]))]
    for kind in QUESTION_TYPES:
        labelled = [[q for q in r.rows if q.kind == kind and q.gold is not None] for r in results]
        if not labelled or not labelled[0]:
            continue
        first = labelled[0]
        series = [("reference", *_conf_correct([q.p_ref for q in first], [int(q.gold or 0) for q in first]))]
        series += [(_name(r.candidate), *_conf_correct([q.p_cand for q in rows], [int(q.gold or 0) for q in rows]))
                   for r, rows in zip(results, labelled, strict=True)]
        images.append((f"reliability: {kind}", plots.reliability_png(f"reliability ({kind})", series)))
        images.append((f"confidence–accuracy: {kind}", plots.confidence_accuracy_png(f"confidence–accuracy ({kind})",
                                                                                    series)))
    return images


def _eval_plots(evals: Sequence[EvalResult]) -> list[tuple[str, str]]:
    from clef_local.quality import plots

    images = []
    for e in evals:
        budget = e.selective.get("budget")
        if budget:
            images.append((f"risk-coverage: {_name(e.model)}", plots.risk_coverage_png(
                f"risk–coverage ({_name(e.model)})", budget)))
    for kind in QUESTION_TYPES:
        series = [(_name(e.model), *_conf_correct([r.probs for r in e.rows if r.kind == kind],
                                                  [r.gold for r in e.rows if r.kind == kind]))
                  for e in evals if any(r.kind == kind for r in e.rows)]
        if series:
            images.append((f"eval reliability: {kind}", plots.reliability_png(f"reliability ({kind})", series)))
    return images


def _worst_html(result: DriftResult, n: int = 5) -> str:
    items = []
    for q in result.worst(n):
        top = np.argsort(-np.asarray(q.p_ref))[:5]
        cand_top = int(np.argmax(q.p_cand))
        shown = [*top.tolist(), *([cand_top] if cand_top not in top else [])]
        dist = ", ".join(f"{html.escape(q.options[i])}: {q.p_ref[i]:.3f}→{q.p_cand[i]:.3f}" for i in shown)
        flag = ' <span class="fail">flip</span>' if q.drift.flipped else ""
        items.append(f"<tr><td>{q.request_index}</td><td>{html.escape(q.state)}</td><td>{html.escape(q.question_id)}"
                     f" ({q.kind}){flag}</td><td class='n'>{q.drift.kl:.4g}</td><td>{dist}</td></tr>")
    return ("<table><tr><th>#</th><th>state</th><th>question</th><th>KL</th><th>p ref → p cand (top options)</th>"
            f"</tr>{''.join(items)}</table>")


def _gates_html(results: Sequence[DriftResult | ProbeResult]) -> str:
    lines = []
    for r in results:
        who = r.candidate if isinstance(r, DriftResult) else r.model
        for gate in r.meta.get("gates", []):
            cls = "ok" if gate["ok"] else "fail"
            lines.append(f"<li class='{cls}'>{html.escape(_name(who))}: {html.escape(gate['expr'])} → "
                         f"{_fmt(gate['value'])} {'pass' if gate['ok'] else 'FAIL'}</li>")
    return f"<h2>Gates</h2><ul>{''.join(lines)}</ul>" if lines else ""


def network_field(values: Iterable[str | None]) -> str:
    """The ``network:`` value of a report from those of its runs: the one value they share (``off (namespace)``,
    ``off (guard)``, ``on``, or ``off`` from results saved before the guard named its kind), ``unknown`` when no run
    recorded one, and ``mixed: on, off (guard)`` (``on`` first) when they differ, so that a report never claims an
    air gap that one of its runs did not have."""
    distinct = list(dict.fromkeys(value for value in values if value))
    if not distinct:
        return "unknown"
    if len(distinct) == 1:
        return distinct[0]
    return "mixed: " + ", ".join(sorted(distinct, key=lambda value: (value != "on", value)))


def _img(images: Sequence[tuple[str, str]]) -> str:
    return "".join(f"<img alt='{html.escape(n)}' src='data:image/png;base64,{b}'>" for n, b in images)


def _probe_html(probes: Sequence[ProbeResult]) -> str:
    from clef_local.quality import plots

    parts = []
    for p in probes:
        level = p.meta.get("intervals", {}).get("confidence", 0.95)
        parts.append(f"<h2>Probe: {html.escape(_name(p.model))}</h2><p class='small'>{html.escape(p.data)} · "
                     f"{p.requests} requests · rewrites seeded ({p.meta.get('seed')}) · [low, high]: {level:.0%} "
                     "intervals (|Δp| and KL: bootstrap over requests; flips: exact binomial)</p>"
                     + _html_table(probe_table_rows(p)) + _img([("probe checks", plots.probe_png(p))]))
    return "".join(parts) + _gates_html(probes)


def render_html(results: Sequence[DriftResult], *, evals: Sequence[EvalResult] = (),
                calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                title: str | None = None, network: str | None = None, probes: Sequence[ProbeResult] = ()) -> str:
    """The report as one HTML string (no external resources)."""
    metas = [r.meta for r in results] + [e.meta for e in evals] + [p.meta for p in probes]
    network = network or network_field(meta.get("network") for meta in metas)
    reference = _name(results[0].reference) if results else ""
    title = title or (f"clef-local drift report: {reference}" if results else
                      f"clef-local probe report: {_name(probes[0].model)}" if probes and not evals
                      else "clef-local report")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p><span class='net{' on' if network.startswith(('on', 'mixed')) else ''}'>network: "
             f"{html.escape(network)}</span> · generated "
             f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}</p>"]
    if results:
        meta = results[0].meta
        level = meta.get("intervals", {}).get("confidence")
        shown = (f" · [low, high]: {level:.0%} intervals (means: bootstrap over requests; flip and error rates: "
                 "exact binomial)" if level else "")
        parts.append(f"<p class='small'>reference <code>{html.escape(results[0].reference)}</code>"
                     f"{' · data ' + html.escape(str(meta['data'])) if meta.get('data') else ''}"
                     f" · {results[0].summary['questions']} questions · KL in nats, flip = argmax changed{shown}</p>")
        if comparison := meta.get("comparison"):
            parts.append("<h2>Which candidate is closer</h2>" + _html_table(comparison_table_rows(comparison)))
        parts.append("<h2>Drift against the reference</h2>" + _html_table(drift_table_rows(results, floor),
                                                                           floor_last=floor is not None))
        parts.append(_gates_html(results))
        per_type = [["candidate", "type", *[label for _, label, _ in DRIFT_COLUMNS]]]
        for r in results:
            for kind, summary in r.by_type.items():
                iv = r.intervals.get(kind, {})
                per_type.append([_name(r.candidate), kind,
                                 *[cell(summary.get(k), iv.get(k), s) for k, _, s in DRIFT_COLUMNS]])
        parts.append("<h3>By question type</h3>" + _html_table(per_type))
        if any(r.labelled for r in results):
            parts.append("<h2>Labelled metrics (reference, candidate and Δ)</h2>"
                         + _html_table(labelled_table_rows(results)))
        parts.append("<h2>Plots</h2>" + "".join(f"<img alt='{html.escape(n)}' src='data:image/png;base64,{b}'>"
                                               for n, b in _drift_plots(results)))
        for r in results:
            parts.append(f"<h3>Worst cases: {html.escape(_name(r.candidate))}</h3>" + _worst_html(r))
    if evals:
        selective = "".join(f"<h3>Selective prediction: {html.escape(_name(e.model))}</h3>"
                            + _html_table(selective_table_rows(e)) for e in evals if e.selective)
        parts.append("<h2>Evaluation</h2>" + _html_table(eval_table_rows(evals)) + selective
                     + "<h3>Speed</h3>" + _html_table(speed_table_rows(evals)) + _img(_eval_plots(evals)))
    if probes:
        parts.append(_probe_html(probes))
    if calibration:
        parts.append("<h2>Recalibration (per-type temperature)</h2>" + _html_table(calibration_table_rows(calibration)))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def render_validation_html(result: Mapping[str, Any], *, verdict: str | None = None) -> str:
    """An export's validation (``validation.json``'s dict, :mod:`clef_local.export.validate`) as one HTML page, in
    the drift report's style: the verdict, then metric, value, threshold and ✓/✗ per check. ``verdict``: the
    export's one line when it was refused (default: passed or failed, from ``result``)."""
    title = f"clef-local validation: {result.get('variant', 'variant')}"
    passed = bool(result.get("passed", result.get("validated")))
    verdict = verdict or ("passed" if passed else "refused: " + ", ".join(result.get("failed", [])))
    rows = [["metric", "value", "threshold", ""]]
    for name, check in result.get("checks", {}).items():
        rows.append([name, _fmt(check.get("value"), ".6g"), "—" if check.get("threshold") is None
                     else f"{check['threshold']:g}", "✓" if check.get("ok") else "✗"])
    shown = " · ".join(f"{key} {html.escape(str(result[key]))}" for key in ("requests", "questions", "flips", "dtype")
                       if key in result)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p class='{'ok' if passed else 'fail'}'>{html.escape(verdict)}</p>",
             f"<p class='small'>reference <code>{html.escape(str(result.get('reference', '')))}</code> · {shown} · "
             f"generated {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}</p>",
             "<h2>Checks</h2>" + _html_table(rows) if len(rows) > 1 else "<p>nothing was measured</p>",
             "</body></html>"]
    return "\n".join(parts)


def render_markdown(results: Sequence[DriftResult], *, evals: Sequence[EvalResult] = (),
                    calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                    network: str | None = None, probes: Sequence[ProbeResult] = ()) -> str:
    """The report's tables as Markdown."""
    parts = []
    if network:
        parts.append(f"network: {network}")
    if results and (comparison := results[0].meta.get("comparison")):
        parts.append(markdown_table(comparison_table_rows(comparison)))
    if results:
        parts.append(f"Drift against `{_name(results[0].reference)}`:\n\n" + markdown_table(
            drift_table_rows(results, floor)))
        if any(r.labelled for r in results):
            parts.append(markdown_table(labelled_table_rows(results)))
    if evals:
        parts.append(markdown_table(eval_table_rows(evals)))
        parts += [markdown_table(selective_table_rows(e)) for e in evals if e.selective]
        parts.append(markdown_table(speed_table_rows(evals)))
    if calibration:
        parts.append(markdown_table(calibration_table_rows(calibration)))
    parts += [f"Probe: `{_name(p.model)}`\n\n" + markdown_table(probe_table_rows(p)) for p in probes]
    return "\n\n".join(parts) + "\n"


def bundle_json(results: Sequence[DriftResult], *, evals: Sequence[EvalResult] = (),
                calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                network: str | None = None, probes: Sequence[ProbeResult] = ()) -> dict[str, Any]:
    return {"format": BUNDLE, "network": network, "drift": [r.to_json() for r in results],
            "floor": floor.to_json() if floor else None, "evals": [e.to_json() for e in evals],
            "calibration": list(calibration), "probes": [p.to_json() for p in probes]}


def write_report(results: Sequence[DriftResult], html_path: str | Path, *, evals: Sequence[EvalResult] = (),
                 calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                 markdown_path: str | Path | None = None, json_path: str | Path | None = None,
                 title: str | None = None, network: str | None = None, probes: Sequence[ProbeResult] = ()) -> Path:
    """Write the HTML report (and optionally Markdown and the JSON bundle); returns the HTML path."""
    html_path = Path(html_path)
    shared: dict[str, Any] = {"evals": evals, "calibration": calibration, "floor": floor, "network": network,
                              "probes": probes}
    html_path.write_text(render_html(results, title=title, **shared), encoding="utf-8")
    if markdown_path:
        Path(markdown_path).write_text(render_markdown(results, **shared), encoding="utf-8")
    if json_path:
        Path(json_path).write_text(json.dumps(bundle_json(results, **shared)) + "\n", encoding="utf-8")
    return html_path


def load_results(paths: Sequence[Path]) -> dict[str, Any]:
    """Merge saved JSON files (bundles, drift, eval or calibration JSON) into ``write_report``'s arguments."""
    merged: dict[str, Any] = {"results": [], "evals": [], "calibration": [], "floor": None, "network": None,
                              "probes": []}
    networks: list[str | None] = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt == BUNDLE:
            merged["results"] += [DriftResult.from_json(d) for d in data["drift"]]
            merged["evals"] += [EvalResult.from_json(d) for d in data.get("evals", [])]
            merged["calibration"] += data.get("calibration", [])
            merged["probes"] += [ProbeResult.from_json(d) for d in data.get("probes", [])]
            merged["floor"] = DriftResult.from_json(data["floor"]) if data.get("floor") else merged["floor"]
            networks.append(data.get("network"))
        elif fmt == "clef-local-drift/1":
            merged["results"].append(DriftResult.from_json(data))
        elif fmt == "clef-local-eval/1":
            merged["evals"].append(EvalResult.from_json(data))
        elif fmt == "clef-local-calibration/1":
            merged["calibration"].append(data)
        elif fmt == "clef-local-probe/1":
            merged["probes"].append(ProbeResult.from_json(data))
        else:
            raise ValueError(f"{path}: not a clef-local result (format {fmt!r}); pass the --json output of drift, "
                             "eval, calibrate or probe")
    networks += [item.meta.get("network") for item in [*merged["results"], *merged["evals"], *merged["probes"]]]
    merged["network"] = network_field(networks) if any(networks) else None
    return merged


def main(argv: list[str] | None = None) -> int:
    """``clef-local report``: re-render saved JSON results as HTML (and Markdown)."""
    parser = argparse.ArgumentParser(prog="clef-local report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, nargs="+", required=True,
                        help="saved drift / eval / calibrate / probe JSON")
    parser.add_argument("--html", type=Path, required=True, help="the HTML file to write")
    parser.add_argument("--md", type=Path, help="also write the tables as Markdown")
    parser.add_argument("--title", help="report title")
    args = parser.parse_args(argv)
    from clef_local.quality.plots import require_matplotlib

    require_matplotlib()  # the HTML report's plots; checked before the results are read
    try:
        merged = load_results(args.json)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_report(merged["results"], args.html, evals=merged["evals"], calibration=merged["calibration"],
                 floor=merged["floor"], markdown_path=args.md, title=args.title, network=merged["network"],
                 probes=merged["probes"])
    print(f"report: {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
