"""Reports: one self-contained HTML file with embedded PNGs, Markdown and JSON, re-rendered from saved JSON."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest

from clef_local.model import Prediction
from clef_local.quality.drift import DriftResult, drift_from_predictions
from clef_local.quality.evaluate import EvalResult, EvalRow, metrics_by_type
from clef_local.quality.report import bundle_json, main, markdown_table, render_markdown, write_report
from clef_local.runtime.encoding import EncodedQuestion, EncodedRecord
from clef_local.runtime.schema import SystemOneRequest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _predictions(rng: np.random.Generator, noise: float, n: int = 30) -> tuple[list[Prediction], list[dict]]:
    base = np.random.default_rng(7)
    preds, labels = [], []
    for i in range(n):
        logits_c = base.normal(size=4) * 2 + rng.normal(size=4) * noise
        logits_n = base.normal(size=2) * 2 + rng.normal(size=2) * noise
        logits_s = base.normal(size=3) + rng.normal(size=3) * noise
        probs = [np.exp(x) / np.exp(x).sum() for x in (logits_n, logits_c, logits_s)]
        questions = (EncodedQuestion("n", 0, (0, 1), ((0, 1),) * 2, ("true", "false")),
                     EncodedQuestion("c", 1, (0, 1), ((0, 1),) * 4, ("a", "b", "c", "d")),
                     EncodedQuestion("s", 2, (0, 1), ((0, 1),) * 3, ("0", "1", "2")))
        request = SystemOneRequest.model_construct(model="m", state=f"<state {i}>", questions={})
        preds.append(Prediction(EncodedRecord((1,), questions, 1, request=request),
                                [p.astype(np.float32) for p in probs]))
        labels.append({"n": bool(i % 2), "c": "abcd"[i % 4], "s": i % 3})
    return preds, labels


@pytest.fixture(scope="module")
def results() -> tuple[list[DriftResult], DriftResult]:
    rng = np.random.default_rng(0)
    ref, labels = _predictions(rng, 0.0)
    out = []
    for name, noise in (("/v/demo-int8", 0.02), ("/v/demo-int4", 0.5)):
        cand, _ = _predictions(rng, noise)
        out.append(drift_from_predictions(ref, cand, [{}] * len(ref), labels=labels, reference_name="/v/bf16",
                                          candidate_name=name, meta={"network": "off", "data": "test"}))
    floor_preds, _ = _predictions(rng, 0.001)
    floor = drift_from_predictions(ref, floor_preds, [{}] * len(ref), labels=labels, reference_name="/v/bf16",
                                   candidate_name="bf16 (float32, torch)")
    return out, floor


def _eval() -> EvalResult:
    rows = [EvalRow("choice", ["a", "b"], [0.8, 0.2], 0), EvalRow("choice", ["a", "b"], [0.3, 0.7], 0),
            EvalRow("noul", ["true", "false"], [0.9, 0.1], 0)]
    return EvalResult("/v/demo-int4", "d.jsonl", 2, 3, metrics_by_type(rows),
                      {"batch_size": 8.0, "requests_per_s": 2.0, "tokens_per_s": 900.0, "ms_per_request": 500.0,
                       "p50_ms": 400.0, "p90_ms": 700.0, "wall_s": 1.0, "compute_s": 1.0}, rows, {"network": "off"})


def test_html_is_self_contained(results, tmp_path: Path):
    drift, floor = results
    path = write_report(drift, tmp_path / "r.html", floor=floor, evals=[_eval()], network="off",
                        markdown_path=tmp_path / "r.md", json_path=tmp_path / "r.json")
    page = path.read_text(encoding="utf-8")
    assert "network: off" in page
    assert not re.search(r"(src|href)=['\"](https?:|//|file:)", page)  # nothing fetched from anywhere
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    # KL histogram, scatter, reliability + confidence-accuracy per type (3 types), eval reliability (2 types)
    assert len(images) == 2 + 2 * 3 + 2
    assert all(base64.b64decode(b).startswith(PNG_MAGIC) for b in images)
    for text in ("demo-int8", "demo-int4", "noise floor: bf16 (float32, torch)", "Worst cases", "&lt;state"):
        assert text in page
    table = page.split("<h2>Drift against the reference</h2>")[1].split("</table>")[0]
    assert table.count("<tr") == 1 + 2 + 1  # header, two candidates, the floor


def test_markdown_and_json_bundle(results):
    drift, floor = results
    md = render_markdown(drift, floor=floor, network="off")
    lines = [x for x in md.splitlines() if x.startswith("| demo-int")]
    assert len(lines) == 2 and "\\|Δp\\|" in md  # pipes inside headers are escaped
    int4 = drift[1].summary
    assert f"{int4['kl_mean']:.4g}" in lines[1]
    assert markdown_table([["a", "b"], ["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
    bundle = json.loads(json.dumps(bundle_json(drift, floor=floor, network="off")))
    assert [DriftResult.from_json(d).summary for d in bundle["drift"]] == [r.summary for r in drift]


def test_report_cli_rerenders_saved_json(results, tmp_path: Path, capsys):
    drift, floor = results
    write_report(drift[:1], tmp_path / "a.html", floor=floor, json_path=tmp_path / "a.json", network="off")
    (tmp_path / "b.json").write_text(json.dumps(drift[1].to_json()))
    (tmp_path / "e.json").write_text(json.dumps(_eval().to_json()))
    cal = {"format": "clef-local-calibration/1", "model": "/v/demo-int4", "objective": "labels",
           "fitted_on": "f", "measured_on": "m", "temperatures": {"choice": 1.5},
           "types": {"choice": {"temperature": 1.5, "before": {"n": 9, "ece": 0.2, "nll": 1.0},
                                "after": {"n": 9, "ece": 0.05, "nll": 0.9}}}}
    (tmp_path / "c.json").write_text(json.dumps(cal))
    assert main(["--json", *(str(tmp_path / f) for f in ("a.json", "b.json", "e.json", "c.json")),
                 "--html", str(tmp_path / "out.html"), "--md", str(tmp_path / "out.md")]) == 0
    page = (tmp_path / "out.html").read_text()
    assert "demo-int8" in page and "demo-int4" in page and "noise floor" in page and "network: off" in page
    assert "ECE before" in page and "0.0500" in page
    assert "| demo-int4 | labels |" in (tmp_path / "out.md").read_text()
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    assert main(["--json", str(tmp_path / "bad.json"), "--html", str(tmp_path / "x.html")]) == 2
    assert "not a clef-local result" in capsys.readouterr().err
