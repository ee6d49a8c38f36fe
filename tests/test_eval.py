"""`clef-local eval`: metrics per type against an independent computation, outputs, speed fields, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clef_local.data.datasets import Example
from clef_local.quality.evaluate import EvalResult, evaluate, main

EXAMPLES = [
    Example("a", {"model": "m", "state": "my card was declined", "questions": {
        "q": {"type": "noul", "instructions": "is it about a card?"},
        "c": {"type": "choice", "criteria": {"card": None, "transfer": None, "fee": None}}}}, {"q": True, "c": "card"}),
    Example("b", {"model": "m", "state": "how long does a transfer take", "questions": {
        "q": {"type": "noul", "instructions": "is it about a card?"},
        "u": {"type": "score", "criteria": ["low", "mid", "high"]}}}, {"q": False, "u": 2}),
    Example("c", {"model": "m", "state": "why was I charged a fee", "questions": {
        "c": {"type": "choice", "criteria": {"card": None, "transfer": None, "fee": None}}}}, {"c": "fee"}),
]


@pytest.fixture(scope="module")
def llama_model(tiny_llama: Path):
    import clef_local

    return clef_local.load(tiny_llama, dtype="float32")


def test_evaluate_metrics_match_direct_computation(llama_model):
    seen = []
    result, predictions = evaluate(llama_model, EXAMPLES, batch_size=2, progress=lambda d, t: seen.append(d))
    # three token lengths on a CPU (no padding allowed there): three batches, progress after each
    assert seen == [1, 2, 3] and result.requests == 3 and result.questions == 5
    assert set(result.metrics) == {"noul", "choice", "score", "all"}
    # choice: questions of a and c, gold card (index 0 of sorted ids card, fee, transfer) and fee (index 1)
    probs = [predictions[0].probabilities[1][:3], predictions[2].probabilities[0][:3]]
    gold = [0, 1]
    choice = result.metrics["choice"]
    assert choice["n"] == 2
    assert choice["nll"] == pytest.approx(float(np.mean([-np.log(p[g]) for p, g in zip(probs, gold, strict=True)])))
    assert choice["accuracy"] == pytest.approx(np.mean([int(np.argmax(p)) == g for p, g in zip(probs, gold,
                                                                                             strict=True)]))
    assert result.metrics["all"]["n"] == 5
    for key in ("requests_per_s", "tokens_per_s", "p50_ms", "p90_ms", "p99_ms", "ms_per_request"):
        assert result.speed[key] > 0
    again = EvalResult.from_json(json.loads(json.dumps(result.to_json())))
    assert again.metrics == result.metrics and len(again.rows) == 5


def test_batched_equals_one_by_one(llama_model):
    batched, _ = evaluate(llama_model, EXAMPLES, batch_size=8)
    single, _ = evaluate(llama_model, EXAMPLES, batch_size=1)
    for a, b in zip(batched.rows, single.rows, strict=True):
        assert np.allclose(a.probs, b.probs, atol=1e-4)
    assert single.speed["batch_size"] == 1.0


def test_eval_cli_outputs(tiny_llama: Path, tmp_path: Path, capsys):
    from clef_local.data.jsonl import write_jsonl

    data = tmp_path / "d.jsonl"
    write_jsonl(EXAMPLES, data)
    code = main(["--model", str(tiny_llama), "--data", str(data), "--limit", "2", "--dtype", "float32",
                 "--no-progress", "--out", str(tmp_path / "p.jsonl"), "--json", str(tmp_path / "m.json"),
                 "--report", str(tmp_path / "r.html")])
    assert code == 0
    out = capsys.readouterr().out
    assert "network: off" in out and "req/s" in out
    preds = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [p["id"] for p in preds] == ["a", "b"] and preds[0]["response"]["answers"]["c"]["type"] == "choice"
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["requests"] == 2 and metrics["meta"]["network"] == "off (guard)"
    page = (tmp_path / "r.html").read_text()
    assert "network: off" in page and "data:image/png;base64," in page


def test_eval_cli_errors(tiny_llama: Path, tmp_path: Path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"state": "s", "questions": {"q": {"type": "noul"}}, "labels": {"q": "maybe"}}\n')
    assert main(["--model", str(tiny_llama), "--data", str(bad), "--no-progress", "--dtype", "float32"]) == 2
    assert "'maybe'" in capsys.readouterr().err
    assert main(["--model", str(tiny_llama), "--data", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
