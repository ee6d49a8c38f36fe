"""The reports' ``network:`` field: the mechanism each run had (namespace, guard, on), and every value when the runs
of one report differ, so a report never claims an air gap one of its runs did not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_local.quality.evaluate import EvalResult, EvalRow, metrics_by_type
from clef_local.quality.report import load_results, network_field, render_html, render_markdown, write_report


def _eval(model: str, network: str | None) -> EvalResult:
    rows = [EvalRow("choice", ["a", "b"], [0.8, 0.2], 0), EvalRow("noul", ["true", "false"], [0.9, 0.1], 0)]
    meta = {} if network is None else {"network": network}
    return EvalResult(model, "d.jsonl", 2, 2, metrics_by_type(rows),
                      {"batch_size": 8.0, "requests_per_s": 2.0, "tokens_per_s": 900.0, "ms_per_request": 500.0,
                       "p50_ms": 400.0, "p90_ms": 700.0, "wall_s": 1.0, "compute_s": 1.0}, rows, meta)


@pytest.mark.parametrize(("values", "expected"), [
    ([], "unknown"), ([None, ""], "unknown"), (["off (namespace)", "off (namespace)"], "off (namespace)"),
    (["off"], "off"), (["off (guard)", "on", None], "mixed: on, off (guard)"),
    (["off (namespace)", "off (guard)"], "mixed: off (guard), off (namespace)"),
])
def test_network_field(values, expected):
    assert network_field(values) == expected


def test_a_report_of_runs_that_differ_names_both(tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps(_eval("/v/int8", "off (namespace)").to_json()))
    (tmp_path / "b.json").write_text(json.dumps(_eval("/v/int4", "on").to_json()))
    merged = load_results([tmp_path / "a.json", tmp_path / "b.json"])
    assert merged["network"] == "mixed: on, off (namespace)"
    page = write_report([], tmp_path / "r.html", evals=merged["evals"], network=merged["network"],
                        markdown_path=tmp_path / "r.md").read_text(encoding="utf-8")
    assert "<span class='net on'>network: mixed: on, off (namespace)</span>" in page
    assert (tmp_path / "r.md").read_text().startswith("network: mixed: on, off (namespace)\n")
    # without an explicit value the page takes it from the runs themselves
    assert "network: mixed: on, off (namespace)" in render_html([], evals=merged["evals"])


def test_one_mechanism_is_shown_as_it_is(tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps(_eval("/v/int8", "off (guard)").to_json()))
    (tmp_path / "c.json").write_text(json.dumps({"format": "clef-local-calibration/1", "model": "/v/int8",
                                                 "objective": "labels", "fitted_on": "f", "measured_on": "m",
                                                 "temperatures": {}, "types": {}}))
    merged = load_results([tmp_path / "a.json", tmp_path / "c.json"])
    assert merged["network"] == "off (guard)"
    assert "<span class='net'>network: off (guard)</span>" in render_html([], evals=merged["evals"])
    assert load_results([tmp_path / "c.json"])["network"] is None
    assert "network: unknown" in render_html([], evals=[_eval("/v/x", None)])
    assert render_markdown([], evals=[], network="off (namespace)").startswith("network: off (namespace)")
