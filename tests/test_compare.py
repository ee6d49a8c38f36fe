"""Which candidate is closer: McNemar against the binomial by hand, the paired bootstrap, the comparison of drift
results, and gates on interval bounds (``@upper95``)."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import numpy as np
import pytest

from clef_local.quality.compare import compare_candidates, mcnemar, paired_difference
from clef_local.quality.drift_cli import GateSyntaxError, drift_lookup, parse_gates
from clef_local.quality.intervals import IntervalSettings, RequestBootstrap
from clef_local.quality.results import DriftResult, QuestionDrift, QuestionRow


def test_mcnemar_is_the_exact_binomial_on_discordant_pairs():
    a = np.array([True] * 10 + [False] * 2 + [True] * 30 + [False] * 58)
    b = np.array([False] * 10 + [True] * 2 + [True] * 30 + [False] * 58)
    result = mcnemar(a, b)
    expected = 2 * sum(comb(12, k) for k in range(3)) / 2**12  # two-sided: 2 · P(X ≤ 2 | 12, ½)
    assert (result["only_a"], result["only_b"]) == (10, 2)
    assert result["p_value"] == pytest.approx(expected, rel=1e-9)
    assert mcnemar(a, a) == {"only_a": 0, "only_b": 0, "p_value": 1.0}
    assert mcnemar([True, False], [False, True])["p_value"] == 1.0
    with pytest.raises(ValueError, match="one entry per question"):
        mcnemar([True], [True, False])


def _result(name: str, kl: np.ndarray, flipped: np.ndarray, requests: np.ndarray,
            gold: list[int | None] | None = None, right: np.ndarray | None = None) -> DriftResult:
    rows = []
    for n, (k, f, r) in enumerate(zip(kl, flipped, requests, strict=True)):
        g = None if gold is None else gold[n]
        p_cand = [0.9, 0.1] if right is None or right[n] else [0.1, 0.9]
        rows.append(QuestionRow(int(r), f"q{n}", "noul", ["true", "false"], [0.9, 0.1], p_cand,
                                QuestionDrift("noul", float(k), float(k) / 2, 0.1, 0.1, bool(f), None, f"q{n}",
                                              int(r)), g))
    summary = {"kl_mean": float(kl.mean()), "flip_rate": float(flipped.mean()), "flips": int(flipped.sum())}
    return DriftResult("ref", name, summary, {}, rows)


def test_compare_candidates_names_the_closer_one_only_when_significant():
    rng = np.random.default_rng(0)
    requests = np.repeat(np.arange(100), 2)
    kl_a = rng.exponential(0.001, 200)
    kl_b = kl_a + rng.exponential(0.004, 200)  # B drifts more on every question
    flips_a = rng.random(200) < 0.02
    flips_b = flips_a | (rng.random(200) < 0.10)
    gold = [0] * 200
    a = _result("dir/int8", kl_a, flips_a, requests, gold, np.ones(200, bool))
    b = _result("dir/int4", kl_b, flips_b, requests, gold, rng.random(200) > 0.2)
    # the same KL values on other questions: the same mean, no real difference
    noisy = _result("dir/int8-again", kl_a[rng.permutation(200)], flips_a, requests)
    [ab] = compare_candidates([a, b], IntervalSettings(resamples=500))
    assert ab["verdict"].startswith("int8 is closer") and ab["kl"]["difference"] > 0
    low, high = ab["kl"]["interval"]
    assert 0 < low < ab["kl"]["difference"] < high
    assert ab["flips"]["only_a"] == 0 and ab["flips"]["p_value"] < 1e-3
    assert ab["correct"]["p_value"] < 0.05 and ab["accuracy"][0] == 1.0
    [an] = compare_candidates([a, noisy], IntervalSettings(resamples=500))
    assert an["verdict"] == "no significant difference at 95%"
    assert compare_candidates([a]) == []
    shifted = _result("x", kl_a, flips_a, requests + 1)
    with pytest.raises(ValueError, match="same questions"):
        compare_candidates([a, shifted])


def test_paired_difference_uses_the_same_resamples_for_both():
    """A constant offset has a zero-width interval when paired; unpaired resampling would not."""
    values = np.random.default_rng(1).normal(size=60)
    boot = RequestBootstrap(np.arange(60), IntervalSettings(resamples=300))
    diff = paired_difference(boot, values, values + 0.25)
    assert diff["difference"] == pytest.approx(0.25)
    assert diff["interval"] == pytest.approx([0.25, 0.25]) and diff["p_value"] == 0.0


def test_gates_on_interval_bounds():
    gates = parse_gates("flips<=0.02@upper95, kl_mean<=0.01, choice.kl_mean >= 0 @ lower95, delta_accuracy>=-0.01"
                        "@lower95")
    assert [(g.kind, g.metric, g.bound) for g in gates] == [
        (None, "flip_rate", "upper"), (None, "kl_mean", None), ("choice", "kl_mean", "lower"),
        (None, "delta_accuracy", "lower")]
    assert parse_gates("flips<=0.02@upper99", level="99")[0].bound == "upper"
    for bad, message in (("flips<=0.02@upper90", "intervals of this run are 95%"),
                         ("flip_count<=3@upper95", "has no interval"), ("kl_max<=1@lower95", "has no interval"),
                         ("flips<=0.02@top95", "is not"), ("nonsense.kl<=1", "unknown scope")):
        with pytest.raises(GateSyntaxError, match=message):
            parse_gates(bad)
    result = DriftResult("r", "c", {"flip_rate": 0.01, "kl_mean": 0.002}, {}, [],
                         labelled={"all": {"delta": {"accuracy": 0.0},
                                           "intervals": {"delta": {"accuracy": [-0.03, 0.02]}}}},
                         intervals={"all": {"flip_rate": [0.004, 0.031], "kl_mean": [0.001, 0.004]}})
    checked = [g.evaluate(drift_lookup(result)) for g in parse_gates(
        "flips<=0.02,flips<=0.02@upper95,kl<=0.005@upper95,delta_accuracy>=-0.02@lower95,delta_accuracy>=-0.02")]
    assert [(c["value"], c["ok"]) for c in checked] == [(0.01, True), (0.031, False), (0.004, True), (-0.03, False),
                                                        (0.0, True)]
    # a bound that was not computed fails its gate rather than passing silently
    assert not parse_gates("score.kl_mean<=1@upper95")[0].evaluate(drift_lookup(result))["ok"]


@pytest.mark.slow
def test_drift_json_has_values_and_intervals(tmp_path: Path, tiny_llama: Path, capsys):
    """Two candidates through the CLI: the comparison comes first, every mean and rate has [low, high] in the JSON
    and the Markdown, and a gate on the upper bound can fail where the point value passes."""
    import shutil

    from clef_local.quality.drift_cli import main

    hotter = tmp_path / "llama-t2"
    shutil.copytree(tiny_llama, hotter)
    config = json.loads((hotter / "config.json").read_text())
    config["clef_local_calibration"] = {"temperatures": {"noul": 2.0, "choice": 2.0, "score": 2.0}}
    (hotter / "config.json").write_text(json.dumps(config))
    args = ["--reference", str(tiny_llama), "--candidate", str(tiny_llama), "--candidate", str(hotter), "--limit",
            "6", "--dtype", "float32", "--no-progress", "--resamples", "200", "--json", str(tmp_path / "d.json"),
            "--md", str(tmp_path / "d.md")]
    assert main([*args, "--gate", "flips<=0.5,kl_mean<=0@upper95"]) == 1
    captured = capsys.readouterr()
    assert "gate failed: llama-t2: kl_mean<=0@upper95" in captured.err
    assert captured.out.index("A vs B") < captured.out.index("KL mean |")  # the comparison table first
    bundle = json.loads((tmp_path / "d.json").read_text())
    same, hot = bundle["drift"]
    assert same["intervals"]["all"]["kl_mean"] == [0.0, 0.0] and same["summary"]["kl_mean"] == 0.0
    low, high = hot["intervals"]["all"]["kl_mean"]
    assert 0 < low <= hot["summary"]["kl_mean"] <= high
    assert hot["meta"]["intervals"] == {"confidence": 0.95, "resamples": 200, "seed": 0,
                                        "bootstrap": "requests, paired, percentile", "rates": "Clopper-Pearson"}
    [pair] = same["meta"]["comparison"]
    assert pair["verdict"].startswith(f"{tiny_llama.name} is closer")
    assert f"{tiny_llama.name} vs llama-t2" in (tmp_path / "d.md").read_text()
    assert main([*args, "--gate", "kl<=1@upper90"]) == 2  # refused before a model is loaded
    assert "--confidence 0.9" in capsys.readouterr().err


def test_drift_intervals_are_seeded():
    """The same seed gives the same intervals, another seed other ones (the bootstrap draws whole requests)."""
    from clef_local.model import Prediction
    from clef_local.quality.drift import drift_from_predictions
    from clef_local.runtime.encoding import EncodedQuestion, EncodedRecord
    from clef_local.runtime.schema import SystemOneRequest

    def prediction(p: np.ndarray) -> Prediction:
        question = EncodedQuestion("c", 1, (0, 1), tuple((0, 1) for _ in p), tuple(f"o{i}" for i in range(len(p))))
        request = SystemOneRequest.model_construct(model="m", state="s", questions={})
        return Prediction(EncodedRecord((1, 2, 3), (question,), 1, request=request), [p.astype(np.float32)])

    rng = np.random.default_rng(0)
    ref, cand = [], []
    for _ in range(30):
        p = rng.dirichlet(np.ones(4))
        ref.append(prediction(p))
        cand.append(prediction(rng.dirichlet(p * 30 + 0.1)))
    runs = [drift_from_predictions(ref, cand, [{}] * 30, intervals=IntervalSettings(resamples=200, seed=s)).intervals
            for s in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]
