"""Selective prediction: thresholds that keep the error within a budget (checked where the true error is known),
eval's intervals and --error-budget, thresholds stored by calibrate beside the temperatures, and batch's marks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from clef_local.quality.intervals import clopper_pearson
from clef_local.quality.selective import apply_thresholds, choose_threshold, error_budget, risk_coverage, upper_bound


def _calibrated(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Confidence c ~ U(0.5, 1), right with probability c: the true error among c ≥ t is (1 − t) / 2."""
    confidence = rng.uniform(0.5, 1.0, n)
    return confidence, rng.random(n) < confidence


def test_risk_coverage_keeps_ties_together():
    curve = risk_coverage(np.array([0.9, 0.9, 0.8, 0.7, 0.7, 0.7]), np.array([1, 0, 1, 1, 1, 0]))
    assert curve["threshold"].tolist() == [0.9, 0.8, 0.7]
    assert curve["covered"].tolist() == [2, 3, 6] and curve["errors"].tolist() == [1, 1, 2]
    assert curve["risk"].tolist() == pytest.approx([0.5, 1 / 3, 1 / 3])


def test_threshold_on_the_upper_bound_keeps_the_true_error_within_the_budget():
    """Over 200 evaluation sets of 10,000 questions, the threshold chosen on the upper bound has a true error over
    the budget in at most ~5% of them; the one chosen on the observed error in far more."""
    rng = np.random.default_rng(0)
    budget = 0.05  # true error (1 − t) / 2 ≤ 0.05 ⇔ t ≥ 0.9
    over = {"upper": 0, "point": 0}
    coverage = []
    for _ in range(200):
        confidence, correct = _calibrated(rng, 10_000)
        for bound in over:
            chosen = choose_threshold(confidence, correct, budget, bound=bound)
            if bound == "upper":
                coverage.append(chosen["coverage"])
            if chosen["threshold"] is None:  # abstaining on everything is never over the budget
                continue
            over[bound] += (1 - chosen["threshold"]) / 2 > budget
            if bound == "upper":
                assert chosen["error_bound"] <= budget and chosen["tested"] <= 50
    assert over["upper"] / 200 <= 0.05, over
    assert over["point"] / 200 > 0.3, over
    assert 0.05 < np.mean(coverage) < 0.2 and np.mean(np.array(coverage) > 0) > 0.9  # t ≥ 0.9 keeps ≤ 20%


def test_choose_threshold_reports_its_numbers():
    confidence = np.linspace(0.5, 1.0, 400)
    correct = np.r_[np.zeros(100, bool), np.ones(300, bool)]  # wrong exactly below 0.625
    t = choose_threshold(confidence, correct, 0.03)  # 0 errors in 228 or more: an upper bound ≤ 3% at 1 − 0.05/50
    assert t["covered"] == 296 and t["errors"] == 0 and t["error"] == 0.0 and t["threshold"] >= confidence[100]
    assert t["error_bound"] == pytest.approx(upper_bound(0, t["covered"], t["bound_level"]))
    assert t["error_interval"] == pytest.approx(list(clopper_pearson(0, t["covered"])))
    assert t["coverage"] == t["covered"] / 400 and t["bound_level"] > 0.95
    nothing = choose_threshold(np.full(20, 0.9), np.zeros(20, bool), 0.02)
    assert nothing["threshold"] is None and nothing["coverage"] == 0.0
    with pytest.raises(ValueError, match="budget"):
        choose_threshold(confidence, correct, 0)


def test_apply_thresholds_counts_and_pools():
    questions = [("choice", 0.9, True), ("choice", 0.8, False), ("choice", 0.4, False), ("noul", 0.99, True),
                 ("noul", 0.6, True), ("score", 0.3, True)]
    out = apply_thresholds(questions, {"choice": 0.75, "noul": 0.95})
    assert (out["choice"]["covered"], out["choice"]["errors"], out["choice"]["coverage"]) == (2, 1, 2 / 3)
    assert (out["noul"]["covered"], out["noul"]["errors"]) == (1, 0) and "score" not in out
    assert (out["all"]["covered"], out["all"]["errors"], out["all"]["n"]) == (3, 1, 5)
    budget = error_budget(questions * 50, 0.3)
    assert set(budget["types"]) == {"choice", "noul", "score"} and budget["types"]["choice"]["curve"]


def test_read_thresholds_old_and_new_files():
    from clef_local.errors import ReleaseError
    from clef_local.model import read_temperatures, read_thresholds

    old = {"clef_local_calibration": {"temperatures": {"choice": 1.2}, "fitted_on": "x", "objective": "labels"}}
    assert read_thresholds(old) == {} and read_temperatures(old) == {"choice": 1.2}
    assert read_thresholds({}) == {}
    new = {"clef_local_calibration": {"temperatures": {"choice": 1.2}, "thresholds": {
        "choice": {"threshold": 0.61, "budget": 0.02}, "noul": {"threshold": None}}}}
    assert read_thresholds(new) == {"choice": 0.61, "noul": float("inf")}
    for bad in ({"choice": 1.5}, {"choice": {"threshold": 2}}, {"vote": {"threshold": 0.5}}, [0.5]):
        with pytest.raises(ReleaseError, match="thresholds must map"):
            read_thresholds({"clef_local_calibration": {"temperatures": {}, "thresholds": bad}})


@pytest.fixture()
def variant(tiny_llama: Path, tmp_path: Path) -> Path:
    from clef_local.formats.manifest import write_manifest

    out = tmp_path / "variant"
    shutil.copytree(tiny_llama, out)
    write_manifest(out, name="tiny variant")
    return out


def _labelled(n: int, path: Path) -> Path:
    """Requests labelled with a fixed option, so that the tiny model is right on some and wrong on others."""
    rows = []
    for i in range(n):
        request = {"model": "m", "state": f"message {i}: {'card' if i % 3 else 'transfer'} " * (1 + i % 4),
                   "questions": {"c": {"type": "choice", "criteria": {"card": None, "transfer": None, "fee": None}},
                                 "n": {"type": "noul", "instructions": "is this about a card?"}}}
        rows.append({**request, "id": f"r{i}", "labels": {"c": "card", "n": bool(i % 2)}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_intervals_and_error_budget(variant: Path, tmp_path: Path, capsys):
    from clef_local.quality.evaluate import main
    from clef_local.quality.results import EvalResult

    data = _labelled(24, tmp_path / "d.jsonl")
    assert main(["--model", str(variant), "--data", str(data), "--dtype", "float32", "--no-progress",
                 "--resamples", "300", "--error-budget", "0.4", "--budget-bound", "point", "--json",
                 str(tmp_path / "e.json"), "--report", str(tmp_path / "e.html")]) == 0
    out = capsys.readouterr().out
    assert "95% intervals" in out and "budget 0.4" in out
    saved = json.loads((tmp_path / "e.json").read_text())
    result = EvalResult.from_json(saved)
    assert {r.request for r in result.rows} == set(range(24))
    for kind, m in result.metrics.items():
        iv = result.intervals[kind]
        assert iv["accuracy"][0] <= m["accuracy"] <= iv["accuracy"][1]
        errors = round((1 - m["accuracy"]) * m["n"])
        assert iv["error_rate"] == pytest.approx(list(clopper_pearson(errors, m["n"])))
    choice = result.selective["budget"]["types"]["choice"]
    assert choice["bound"] == "point" and (choice["threshold"] is None or choice["error"] <= 0.4)
    assert "risk-coverage" in (tmp_path / "e.html").read_text()
    old = {k: v for k, v in saved.items() if k not in ("intervals", "selective")}
    old["rows"] = [{k: v for k, v in r.items() if k != "request"} for r in saved["rows"]]
    assert EvalResult.from_json(old).rows[0].request == -1  # results saved before intervals still load


@pytest.mark.slow
def test_calibrate_stores_thresholds_and_batch_marks_answers_under_them(variant: Path, tmp_path: Path, capsys):
    import clef_local
    from clef_local.batch.job import main as batch_main
    from clef_local.formats.manifest import verify
    from clef_local.quality.calibrate import main as calibrate_main

    data = _labelled(12, tmp_path / "fit.jsonl")
    assert calibrate_main(["--model", str(variant), "--data", str(data), "--dtype", "float32", "--error-budget",
                           "0.3", "--budget-bound", "point"]) == 0
    assert "threshold" in capsys.readouterr().out
    entry = json.loads((variant / "config.json").read_text())["clef_local_calibration"]
    assert set(entry["temperatures"]) == {"choice", "noul"} and verify(variant) == []
    stored = {k: v["threshold"] for k, v in entry["thresholds"].items()}
    assert entry["thresholds"]["choice"]["budget"] == 0.3 and entry["thresholds"]["choice"]["bound"] == "point"
    model = clef_local.load(variant, dtype="float32")
    assert model.thresholds == {k: float("inf") if v is None else v for k, v in stored.items()}
    expected = {}
    for n, pred in enumerate(model.predict([json.loads(line) for line in data.read_text().splitlines()])):
        expected[f"r{n}"] = [q.question_id for q, p in zip(pred.encoded.questions, pred.probabilities, strict=True)
                             if float(p[: len(q.option_ids)].max()) < model.thresholds[
                                 {0: "noul", 1: "choice", 2: "score"}[q.question_type]]]
    assert any(expected.values())  # the tiny random model is unsure: some answers fall under the thresholds
    out = tmp_path / "answers.jsonl"
    assert batch_main(["--model", str(variant), "--in", str(data), "--out", str(out), "--dtype", "float32",
                       "--no-progress"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert {line["id"]: line["below_threshold"] for line in lines} == expected
    pytest.importorskip("pyarrow")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(json.loads(data.read_text().splitlines()[0])["questions"]))
    table_in = tmp_path / "in.csv"
    table_in.write_text("id,state\n" + "".join(f"r{n},\"{json.loads(x)['state']}\"\n"
                                               for n, x in enumerate(data.read_text().splitlines())))
    csv_out = tmp_path / "labels.csv"
    assert batch_main(["--model", str(variant), "--in", str(table_in), "--schema", str(schema), "--out",
                       str(csv_out), "--dtype", "float32", "--no-progress"]) == 0
    import csv

    rows = list(csv.DictReader(csv_out.open()))
    assert {"c.below_threshold", "n.below_threshold"} <= set(rows[0])
    assert {r["id"]: [q for q in ("c", "n") if r[f"{q}.below_threshold"] == "true"] for r in rows} == expected
