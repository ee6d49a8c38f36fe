"""Drift metrics on constructed cases, the drift run on tiny releases, and the CLI's gates and exit codes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from clef_local.model import Prediction
from clef_local.quality.drift import (
    DriftResult,
    compare_predictions,
    drift_from_predictions,
    gold_index,
    question_drift,
    run_drift,
    summarize,
)
from clef_local.quality.drift_cli import GateSyntaxError, parse_gates
from clef_local.runtime.encoding import EncodedQuestion, EncodedRecord
from clef_local.runtime.schema import SystemOneRequest


def test_identical_distributions_have_zero_drift():
    p = np.array([0.1, 0.2, 0.7], dtype=np.float32)
    d = question_drift(p, p.copy(), "choice")
    assert d.kl == 0.0 and d.js == 0.0 and d.max_abs == 0.0 and d.rms == 0.0 and not d.flipped
    assert d.score_shift is None
    # zeros in the reference contribute nothing, even where the candidate is also zero
    assert question_drift(np.array([1.0, 0.0]), np.array([1.0, 0.0]), "noul").kl == 0.0


def test_kl_js_by_hand():
    p, q = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    d = question_drift(p, q, "noul")
    assert d.kl == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    m = np.array([0.7, 0.3])
    js = 0.5 * sum(p * np.log(p / m)) + 0.5 * sum(q * np.log(q / m))
    assert d.js == pytest.approx(js)
    assert d.max_abs == pytest.approx(0.4) and d.rms == pytest.approx(0.4)
    assert not d.flipped  # the tie [0.5, 0.5] resolves to option 0, as does [0.9, 0.1]


def test_flips_on_constructed_cases():
    # ties resolve to the first option: [0.5, 0.5] → 0, [0.1, 0.9] → 1: a flip; [0.9, 0.1] → 0: none
    assert question_drift(np.array([0.5, 0.5]), np.array([0.1, 0.9]), "noul").flipped
    assert not question_drift(np.array([0.5, 0.5]), np.array([0.9, 0.1]), "noul").flipped
    assert not question_drift(np.array([0.2, 0.4, 0.4]), np.array([0.2, 0.4, 0.4]), "choice").flipped
    assert question_drift(np.array([0.2, 0.41, 0.39]), np.array([0.2, 0.39, 0.41]), "choice").flipped
    drifts = [question_drift(np.array(a), np.array(b), "noul")
              for a, b in [([0.6, 0.4], [0.4, 0.6]), ([0.6, 0.4], [0.7, 0.3]), ([0.3, 0.7], [0.5, 0.5]),
                           ([0.3, 0.7], [0.2, 0.8])]]
    summary = summarize(drifts)
    assert summary["flips"] == 2 and summary["flip_rate"] == pytest.approx(0.5)


def test_score_shift_and_validation():
    d = question_drift(np.array([0.2, 0.3, 0.5]), np.array([0.5, 0.3, 0.2]), "score")
    assert d.score_shift == pytest.approx((0.3 + 0.4) - (0.3 + 1.0))
    with pytest.raises(ValueError, match="2 options and p_cand 3"):
        question_drift(np.array([0.5, 0.5]), np.array([0.2, 0.3, 0.5]), "choice")
    with pytest.raises(ValueError, match="kind"):
        question_drift(np.array([1.0]), np.array([1.0]), "yesno")


def test_js_is_bounded_and_kl_eps_safe():
    d = question_drift(np.array([1.0, 0.0]), np.array([0.0, 1.0]), "noul")
    assert d.js == pytest.approx(math.log(2)) and math.isfinite(d.kl) and d.kl > 20


def test_gold_index():
    assert gold_index(("true", "false"), True) == 0 and gold_index(("true", "false"), False) == 1
    assert gold_index(("0", "1", "2"), 2) == 2 and gold_index(("a", "b"), "b") == 1
    with pytest.raises(ValueError, match="'zz'"):
        gold_index(("a", "b"), "zz")


def _prediction(kinds_probs: list[tuple[int, str, list[float]]], state: str = "s") -> Prediction:
    questions = []
    for qtype, qid, probs in kinds_probs:
        ids = {0: ("true", "false"), 2: tuple(str(i) for i in range(len(probs)))}.get(
            qtype, tuple(f"o{i}" for i in range(len(probs))))
        questions.append(EncodedQuestion(qid, qtype, (0, 1), tuple((0, 1) for _ in probs), ids))
    request = SystemOneRequest.model_construct(model="m", state=state, questions={})
    encoded = EncodedRecord((1, 2, 3), tuple(questions), 1, request=request)
    return Prediction(encoded, [np.asarray(p, np.float32) for _, _, p in kinds_probs])


def test_compare_predictions_and_result_json_roundtrip():
    ref = [_prediction([(0, "a", [0.7, 0.3]), (1, "c", [0.2, 0.5, 0.3])]),
           _prediction([(2, "s", [0.1, 0.2, 0.7])], state="x" * 400)]
    cand = [_prediction([(0, "a", [0.4, 0.6]), (1, "c", [0.2, 0.5, 0.3])]),
            _prediction([(2, "s", [0.1, 0.3, 0.6])])]
    drifts = compare_predictions(ref, cand)
    assert [(d.kind, d.question_id, d.request_index, d.flipped) for d in drifts] == [
        ("noul", "a", 0, True), ("choice", "c", 0, False), ("score", "s", 1, False)]
    labels = [{"a": True, "c": "o1"}, {"s": 2}]
    result = drift_from_predictions(ref, cand, [{}, {}], labels=labels)
    assert result.summary["flips"] == 1 and set(result.by_type) == {"noul", "choice", "score"}
    assert result.labelled["noul"]["reference"]["accuracy"] == 1.0
    assert result.labelled["noul"]["candidate"]["accuracy"] == 0.0
    assert result.labelled["noul"]["delta"]["accuracy"] == -1.0
    assert len(result.rows[2].state) == 160 and result.worst(1)[0].question_id == "a"
    again = DriftResult.from_json(json.loads(json.dumps(result.to_json())))
    assert again.summary == result.summary and again.rows[0].drift == result.rows[0].drift
    with pytest.raises(ValueError, match="format"):
        DriftResult.from_json({"format": "x"})


def test_parse_gates():
    gates = parse_gates("flips<=0.01, kl_mean<=0.002,choice.kl_max<1,delta_ece<=0.01")
    assert [(g.kind, g.metric, g.op, g.threshold) for g in gates] == [
        (None, "flip_rate", "<=", 0.01), (None, "kl_mean", "<=", 0.002), ("choice", "kl_max", "<", 1.0),
        (None, "delta_ece", "<=", 0.01)]
    for bad in ("flips=0.01", "kl_mean<=x", "nonsense<=1", "kl_mean"):
        with pytest.raises(GateSyntaxError):
            parse_gates(bad)


@pytest.fixture(scope="module")
def tempered(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with a stored temperature of 3 on every type: the same argmax, flatter distributions."""
    out = tmp_path_factory.mktemp("tempered") / "llama-t3"
    shutil.copytree(tiny_llama, out)
    config = json.loads((out / "config.json").read_text())
    config["clef_local_calibration"] = {"temperatures": {"noul": 3.0, "choice": 3.0, "score": 3.0}}
    (out / "config.json").write_text(json.dumps(config))
    return out


REQUESTS = [
    {"model": "m", "state": "my card was declined", "questions": {
        "q": {"type": "noul", "instructions": "is it about a card?"},
        "c": {"type": "choice", "criteria": {"card": None, "transfer": None, "fee": "a fee"}}}},
    {"model": "m", "state": "how long does a transfer take", "questions": {
        "u": {"type": "score", "criteria": ["low", "mid", "high"]}}},
]


def test_builtin_probe_set_does_not_import_export() -> None:
    """``clef-local drift`` without ``--data`` takes the probes from clef_local.data, not from the export package."""
    import subprocess
    import sys

    code = ("import argparse, sys\n"
            "from clef_local.quality.command import read_requests\n"
            "read = read_requests(argparse.Namespace(data=None, limit=8))\n"
            "requests, labels, source = read.requests, read.labels, read.source\n"
            "assert len(requests) == 8 and labels is None and 'built-in probe set' in source\n"
            "print(sorted(m for m in sys.modules if m.startswith('clef_local.export')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_run_drift_self_is_zero_and_temperature_keeps_argmax(tiny_llama: Path, tempered: Path):
    import clef_local

    ref = clef_local.load(tiny_llama, dtype="float32")
    seen = []
    same = run_drift(ref, ref, REQUESTS, batch_size=1, progress=lambda d, t: seen.append((d, t)))
    assert same.summary["kl_max"] == 0.0 and same.summary["flips"] == 0
    assert seen[-1] == (4, 4)
    cand = clef_local.load(tempered, dtype="float32")
    moved = run_drift(ref, cand, REQUESTS, labels=[{"q": True, "c": "card"}, {"u": 1}])
    assert moved.summary["kl_mean"] > 0 and moved.summary["flips"] == 0
    assert set(moved.labelled) == {"noul", "choice", "score", "all"}
    # the tempered candidate's probabilities are softmax(log p_ref / 3)
    row = moved.rows[1]
    z = np.log(np.asarray(row.p_ref)) / 3
    assert np.allclose(row.p_cand, np.exp(z) / np.exp(z).sum(), atol=1e-5)


def _write_data(path: Path) -> Path:
    from clef_local.data.datasets import Example
    from clef_local.data.jsonl import write_jsonl

    write_jsonl([Example("r0", REQUESTS[0], {"q": True, "c": "card"}), Example("r1", REQUESTS[1], {"u": 2})], path)
    return path


def test_drift_cli_gates_and_outputs(tiny_llama: Path, tempered: Path, tmp_path: Path, capsys):
    from clef_local.quality.drift_cli import main

    data = _write_data(tmp_path / "d.jsonl")
    base = ["--reference", str(tiny_llama), "--candidate", str(tempered), "--data", str(data), "--dtype", "float32",
            "--no-progress"]
    assert main([*base, "--gate", "flips<=0,kl_mean<=100", "--json", str(tmp_path / "r.json"),
                 "--md", str(tmp_path / "r.md")]) == 0
    out = capsys.readouterr().out
    assert "network: off" in out and "gates passed" in out
    bundle = json.loads((tmp_path / "r.json").read_text())
    assert bundle["network"] == "off (guard)" and bundle["drift"][0]["summary"]["flips"] == 0
    assert bundle["drift"][0]["meta"]["head"] == "same as the reference's"  # a temperature is not a new head
    assert "| llama-t3 |" in (tmp_path / "r.md").read_text()
    assert main([*base, "--gate", "kl_mean<=0"]) == 1
    assert "gate failed: llama-t3: kl_mean<=0" in capsys.readouterr().err
    assert main([*base, "--gate", "kl_mean=<0"]) == 2
    assert "kl_mean=<0" in capsys.readouterr().err


def test_drift_cli_floor(tiny_llama: Path, tmp_path: Path, capsys):
    from clef_local.quality.drift_cli import main

    data = _write_data(tmp_path / "d.jsonl")
    assert main(["--reference", str(tiny_llama), "--candidate", str(tiny_llama), "--data", str(data), "--floor",
                 "--dtype", "float32", "--no-progress", "--json", str(tmp_path / "f.json")]) == 0
    bundle = json.loads((tmp_path / "f.json").read_text())
    assert bundle["floor"]["candidate"].endswith("(bfloat16, auto)")
    assert 0 < bundle["floor"]["summary"]["kl_mean"] < 0.01
    assert "noise floor" in capsys.readouterr().out


def test_drift_names_a_candidate_whose_head_is_not_the_references(tiny_llama: Path, tmp_path: Path, capsys, caplog):
    """A variant copies its source's head byte for byte: a candidate with another head (exported before the
    reference's head was retrained, say) is named, in the CLI's stderr, the JSON and run_drift's log."""
    import logging

    from safetensors.torch import load_file, save_file

    import clef_local
    from clef_local.quality.drift_cli import main

    other = tmp_path / "other-head"
    shutil.copytree(tiny_llama, other)
    tensors = load_file(other / "joint_head.safetensors")
    tensors["residual_gate"] = tensors["residual_gate"] + 1.0
    save_file(tensors, other / "joint_head.safetensors")
    data = _write_data(tmp_path / "d.jsonl")
    assert main(["--reference", str(tiny_llama), "--candidate", str(other), "--data", str(data), "--dtype", "float32",
                 "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "joint_head.safetensors differ" in err and "re-export" in err
    head = json.loads((tmp_path / "r.json").read_text())["drift"][0]["meta"]["head"]
    assert head.startswith(str(other)) and "joint_head_config.json" not in head
    with caplog.at_level(logging.WARNING, logger="clef_local.quality.drift"):
        run_drift(clef_local.load(tiny_llama, dtype="float32"), clef_local.load(other, dtype="float32"), REQUESTS)
    assert any("two different heads" in r.getMessage() for r in caplog.records)
