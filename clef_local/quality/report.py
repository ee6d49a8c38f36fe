"""Drift / eval / calibration reports: one self-contained HTML file (plots embedded as PNG), Markdown and JSON.

:func:`write_report` puts any number of candidates' drift against one reference in one table (the noise floor
beside them), with evals and calibrations, and states the runs' network state at the top (:func:`network_field`
names every value when they differ). ``clef-local report`` re-renders saved JSON. docs/quality.md#report.
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

from clef_local.quality.results import DriftResult, EvalResult
from clef_local.runtime.schema import QUESTION_TYPES

BUNDLE = "clef-local-report/1"
DRIFT_COLUMNS = (("questions", "questions", "d"), ("kl_mean", "KL mean", "g"), ("kl_p99", "KL p99", "g"),
                 ("kl_max", "KL max", "g"), ("js_mean", "JS mean", "g"), ("max_abs_max", "max |Δp|", ".4f"),
                 ("rms_mean", "RMS Δp", ".4f"), ("flip_rate", "flip rate", ".2%"), ("flips", "flips", "d"),
                 ("score_shift_mean_abs", "|score shift|", ".4f"))
LABEL_METRICS = ("accuracy", "macro_f1", "nll", "brier", "ece", "adaptive_ece")
CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#1d1d1f;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 20px;font-size:13px}th,td{border:1px solid #ccd;padding:3px 8px}
th{background:#eef1f7}td.n{text-align:right;font-variant-numeric:tabular-nums}.floor{color:#666;font-style:italic}
.fail{color:#b00020;font-weight:600}.ok{color:#1b7a3a}img{max-width:49%;border:1px solid #eee;margin:2px}
.net{display:inline-block;padding:2px 8px;border-radius:4px;background:#e4f4e8}.small{font-size:12px;color:#555}
.net.on{background:#fbe4e4}code{background:#f3f3f3;padding:1px 3px}"""


def _fmt(value: Any, spec: str = "g") -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "—"
    if spec == "d":
        return str(int(value))
    if spec == "g":
        return f"{value:.4g}"
    return format(value, spec)


def _name(path: str) -> str:
    return Path(path).name or path


def drift_table_rows(results: Sequence[DriftResult], floor: DriftResult | None = None) -> list[list[str]]:
    """Header plus one row per candidate (and the noise floor last): the overall drift summary."""
    rows = [["candidate", *[label for _, label, _ in DRIFT_COLUMNS]]]
    for result, is_floor in [*((r, False) for r in results), *([(floor, True)] if floor else [])]:
        name = f"noise floor: {result.candidate}" if is_floor else _name(result.candidate)
        rows.append([name, *[_fmt(result.summary.get(key), spec) for key, _, spec in DRIFT_COLUMNS]])
    return rows


def labelled_table_rows(results: Sequence[DriftResult]) -> list[list[str]]:
    """Per type: the reference's labelled metrics, then each candidate's value and delta."""
    rows = [["type", "metric", "reference", *[f"{_name(r.candidate)} (Δ)" for r in results]]]
    if not results:
        return rows
    for kind in (*QUESTION_TYPES, "all"):
        first = results[0].labelled.get(kind)
        if not first:
            continue
        for metric in LABEL_METRICS:
            cells = [kind, metric, _fmt(first["reference"][metric], ".4f")]
            for r in results:
                entry = r.labelled.get(kind)
                cells.append("—" if not entry else f"{entry['candidate'][metric]:.4f} "
                                                   f"({entry['delta'][metric]:+.4f})")
            rows.append(cells)
    return rows


def eval_table_rows(evals: Sequence[EvalResult]) -> list[list[str]]:
    rows = [["model", "type", "n", *LABEL_METRICS]]
    for e in evals:
        for kind, m in e.metrics.items():
            rows.append([_name(e.model), kind, str(m["n"]), *[_fmt(m[k], ".4f") for k in LABEL_METRICS]])
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


def _gates_html(results: Sequence[DriftResult]) -> str:
    lines = []
    for r in results:
        for gate in r.meta.get("gates", []):
            cls = "ok" if gate["ok"] else "fail"
            lines.append(f"<li class='{cls}'>{html.escape(_name(r.candidate))}: {html.escape(gate['expr'])} → "
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


def render_html(results: Sequence[DriftResult], *, evals: Sequence[EvalResult] = (),
                calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                title: str | None = None, network: str | None = None) -> str:
    """The report as one HTML string (no external resources)."""
    metas = [r.meta for r in results] + [e.meta for e in evals]
    network = network or network_field(meta.get("network") for meta in metas)
    reference = _name(results[0].reference) if results else ""
    title = title or (f"clef-local drift report: {reference}" if results else "clef-local report")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<p><span class='net{' on' if network.startswith(('on', 'mixed')) else ''}'>network: "
             f"{html.escape(network)}</span> · generated "
             f"{dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}</p>"]
    if results:
        meta = results[0].meta
        parts.append(f"<p class='small'>reference <code>{html.escape(results[0].reference)}</code>"
                     f"{' · data ' + html.escape(str(meta['data'])) if meta.get('data') else ''}"
                     f" · {results[0].summary['questions']} questions · KL in nats, flip = argmax changed</p>")
        parts.append("<h2>Drift against the reference</h2>" + _html_table(drift_table_rows(results, floor),
                                                                           floor_last=floor is not None))
        parts.append(_gates_html(results))
        per_type = [["candidate", "type", *[label for _, label, _ in DRIFT_COLUMNS]]]
        for r in results:
            for kind, summary in r.by_type.items():
                per_type.append([_name(r.candidate), kind, *[_fmt(summary.get(k), s) for k, _, s in DRIFT_COLUMNS]])
        parts.append("<h3>By question type</h3>" + _html_table(per_type))
        if any(r.labelled for r in results):
            parts.append("<h2>Labelled metrics (reference, candidate and Δ)</h2>"
                         + _html_table(labelled_table_rows(results)))
        parts.append("<h2>Plots</h2>" + "".join(f"<img alt='{html.escape(n)}' src='data:image/png;base64,{b}'>"
                                               for n, b in _drift_plots(results)))
        for r in results:
            parts.append(f"<h3>Worst cases: {html.escape(_name(r.candidate))}</h3>" + _worst_html(r))
    if evals:
        parts.append("<h2>Evaluation</h2>" + _html_table(eval_table_rows(evals))
                     + "<h3>Speed</h3>" + _html_table(speed_table_rows(evals))
                     + "".join(f"<img alt='{html.escape(n)}' src='data:image/png;base64,{b}'>"
                               for n, b in _eval_plots(evals)))
    if calibration:
        parts.append("<h2>Recalibration (per-type temperature)</h2>" + _html_table(calibration_table_rows(calibration)))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def render_markdown(results: Sequence[DriftResult], *, evals: Sequence[EvalResult] = (),
                    calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                    network: str | None = None) -> str:
    """The report's tables as Markdown."""
    parts = []
    if network:
        parts.append(f"network: {network}")
    if results:
        parts.append(f"Drift against `{_name(results[0].reference)}`:\n\n" + markdown_table(
            drift_table_rows(results, floor)))
        if any(r.labelled for r in results):
            parts.append(markdown_table(labelled_table_rows(results)))
    if evals:
        parts += [markdown_table(eval_table_rows(evals)), markdown_table(speed_table_rows(evals))]
    if calibration:
        parts.append(markdown_table(calibration_table_rows(calibration)))
    return "\n\n".join(parts) + "\n"


def bundle_json(results: Sequence[DriftResult], *, evals: Sequence[EvalResult] = (),
                calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                network: str | None = None) -> dict[str, Any]:
    return {"format": BUNDLE, "network": network, "drift": [r.to_json() for r in results],
            "floor": floor.to_json() if floor else None, "evals": [e.to_json() for e in evals],
            "calibration": list(calibration)}


def write_report(results: Sequence[DriftResult], html_path: str | Path, *, evals: Sequence[EvalResult] = (),
                 calibration: Sequence[Mapping[str, Any]] = (), floor: DriftResult | None = None,
                 markdown_path: str | Path | None = None, json_path: str | Path | None = None,
                 title: str | None = None, network: str | None = None) -> Path:
    """Write the HTML report (and optionally Markdown and the JSON bundle); returns the HTML path."""
    html_path = Path(html_path)
    html_path.write_text(render_html(results, evals=evals, calibration=calibration, floor=floor, title=title,
                                     network=network), encoding="utf-8")
    if markdown_path:
        Path(markdown_path).write_text(render_markdown(results, evals=evals, calibration=calibration, floor=floor,
                                                       network=network), encoding="utf-8")
    if json_path:
        Path(json_path).write_text(json.dumps(bundle_json(results, evals=evals, calibration=calibration, floor=floor,
                                                          network=network)) + "\n", encoding="utf-8")
    return html_path


def load_results(paths: Sequence[Path]) -> dict[str, Any]:
    """Merge saved JSON files (bundles, drift, eval or calibration JSON) into ``write_report``'s arguments."""
    merged: dict[str, Any] = {"results": [], "evals": [], "calibration": [], "floor": None, "network": None}
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
            merged["floor"] = DriftResult.from_json(data["floor"]) if data.get("floor") else merged["floor"]
            networks.append(data.get("network"))
        elif fmt == "clef-local-drift/1":
            merged["results"].append(DriftResult.from_json(data))
        elif fmt == "clef-local-eval/1":
            merged["evals"].append(EvalResult.from_json(data))
        elif fmt == "clef-local-calibration/1":
            merged["calibration"].append(data)
        else:
            raise ValueError(f"{path}: not a clef-local result (format {fmt!r}); pass the --json output of drift, "
                             "eval or calibrate")
    networks += [item.meta.get("network") for item in [*merged["results"], *merged["evals"]]]
    merged["network"] = network_field(networks) if any(networks) else None
    return merged


def main(argv: list[str] | None = None) -> int:
    """``clef-local report``: re-render saved JSON results as HTML (and Markdown)."""
    parser = argparse.ArgumentParser(prog="clef-local report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, nargs="+", required=True, help="saved drift / eval / calibrate JSON")
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
                 floor=merged["floor"], markdown_path=args.md, title=args.title, network=merged["network"])
    print(f"report: {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
