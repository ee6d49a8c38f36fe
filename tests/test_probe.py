"""`clef-local probe`: each rewrite and how its answers map back, the checks on a tiny release, a seeded fault (a
backend that reads options in the order they are listed) caught by the option-order check, and the command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from clef_local.quality.probe import CHECKS, check_rng, mapped_back, run_probe, transform

REQUEST = {"model": "m", "state": "my card was charged twice", "questions": {
    "team": {"type": "choice",
             "criteria": {"transfers": None, "cards": "Card payments", "fees": "Fees", "loans": None}},
    "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    "bare": {"type": "noul"}}}


def test_rewrites_change_what_they_say_and_nothing_else():
    rng = random.Random(0)
    order = transform("option_order", REQUEST, rng)
    assert order is not None and list(order.request["questions"]["team"]["criteria"]) != \
        list(REQUEST["questions"]["team"]["criteria"])
    assert order.request["questions"]["team"]["criteria"] == REQUEST["questions"]["team"]["criteria"]  # same items
    assert order.request["questions"]["urgency"] == REQUEST["questions"]["urgency"]  # levels keep their order
    questions = transform("question_order", REQUEST, rng)
    assert list(questions.request["questions"]) != list(REQUEST["questions"])
    assert questions.request["questions"] == REQUEST["questions"]
    ids = transform("question_ids", REQUEST, rng)
    assert sorted(ids.questions.values()) == sorted(REQUEST["questions"]) and not set(ids.request["questions"]) & \
        set(REQUEST["questions"])
    renamed = {ids.questions[k]: v for k, v in ids.request["questions"].items()}
    assert renamed["bare"]["instructions"] == "bare"  # it was asked by its id: the text stays
    assert renamed["refund"] == REQUEST["questions"]["refund"]
    options = transform("option_ids", REQUEST, rng)
    back = options.options["team"]
    criteria = options.request["questions"]["team"]["criteria"]
    assert {back[k]: v for k, v in criteria.items()} == {"transfers": "transfers", "cards": "Card payments",
                                                         "fees": "Fees", "loans": "loans"}
    context = transform("irrelevant_context", REQUEST, rng)
    assert context.request["state"].startswith(REQUEST["state"] + "\n\n") and context.request["questions"] == \
        REQUEST["questions"]
    assert isinstance(transform("irrelevant_context", {**REQUEST, "state": {"a": 1}}, rng).request["state"], dict)
    assert transform("state_format", REQUEST, rng).request["state"] == {"message": REQUEST["state"]}
    assert transform("state_format", {**REQUEST, "state": {"amount": 12, "note": "x"}}, rng).request["state"] == \
        "amount: 12\nnote: x"
    single = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
    assert transform("question_order", single, rng) is None and transform("option_order", single, rng) is None
    a = transform("option_ids", REQUEST, check_rng(3, "option_ids"))
    b = transform("option_ids", REQUEST, check_rng(3, "option_ids"))
    assert a == b != transform("option_ids", REQUEST, check_rng(4, "option_ids"))
    with pytest.raises(ValueError, match="unknown probe check"):
        transform("nonsense", REQUEST, rng)


def test_mapped_back_reads_renamed_options_under_their_own_ids(qwen_model):
    how = transform("option_ids", REQUEST, random.Random(1))
    original, rewritten = qwen_model.predict([REQUEST, how.request])
    mapped = mapped_back(original, rewritten, how)
    team = [q.question_id for q in original.encoded.questions].index("team")
    by_new = dict(zip(rewritten.encoded.questions[team].option_ids, rewritten.probabilities[team], strict=False))
    expected = [by_new[next(k for k, v in how.options["team"].items() if v == o)]
                for o in original.encoded.questions[team].option_ids]
    assert np.allclose(mapped[team], expected) and mapped[team].sum() == pytest.approx(1.0, abs=1e-5)


def _requests() -> list[dict]:
    from clef_local.data.probes import probe_requests

    return probe_requests(8, seed=0)


@pytest.mark.slow
def test_probe_on_a_tiny_release_and_a_seeded_fault(tiny_llama: Path):
    """The encoder sorts a choice's options, so listing them in another order must not move a probability at all;
    a backend that reads them in the listed order is caught there, while the checks that keep the listed order see
    exactly what they saw before."""
    import clef_local
    from clef_local.quality.intervals import IntervalSettings
    from clef_local.testing import ListedOrderFault

    settings = IntervalSettings(resamples=200)
    checks = ("option_order", "question_order", "state_format")
    model = clef_local.load(tiny_llama, dtype="float32")
    clean = run_probe(model, _requests(), settings=settings, checks=checks)
    assert list(clean.checks) == list(checks) and set(checks) < set(CHECKS)
    order = clean.checks["option_order"]
    assert order["questions"] > 0 and order["mean_abs_dp"] <= 1e-6 and order["flips"] == 0
    for check, entry in clean.checks.items():
        assert entry["intervals"]["mean_abs_dp"][0] <= entry["mean_abs_dp"] <= entry["intervals"]["mean_abs_dp"][1]
        assert entry["intervals"]["flip_rate"][0] == 0.0 or entry["flips"] > 0, check
    model.backend = ListedOrderFault(model.backend)
    faulty = run_probe(model, _requests(), settings=settings, checks=checks)
    caught = faulty.checks["option_order"]
    assert caught["mean_abs_dp"] > 0.01 and caught["flips"] > 0 and caught["intervals"]["flip_rate"][0] > 0
    for check in ("question_order", "state_format"):
        assert faulty.checks[check]["mean_abs_dp"] == pytest.approx(clean.checks[check]["mean_abs_dp"], abs=1e-6)


@pytest.mark.slow
def test_probe_cli_gates_outputs_and_report(tiny_llama: Path, tmp_path: Path, capsys):
    from clef_local.data.datasets import Example
    from clef_local.data.jsonl import write_jsonl
    from clef_local.quality.probe_cli import main
    from clef_local.quality.report import main as report_main

    data = tmp_path / "requests.jsonl"
    write_jsonl([Example(f"r{n}", r, {}) for n, r in enumerate(_requests())], data)
    base = ["--model", str(tiny_llama), "--data", str(data), "--dtype", "float32", "--no-progress", "--resamples",
            "200"]
    assert main([*base, "--gate", "option_order.dp<=0.000001,option_order.flips<=0.7@upper95", "--json",
                 str(tmp_path / "p.json"), "--md", str(tmp_path / "p.md"), "--report", str(tmp_path / "p.html")]) == 0
    out = capsys.readouterr().out
    assert "gates passed" in out and "| option_order |" in out and "network: off" in out
    bundle = json.loads((tmp_path / "p.json").read_text())
    [probe] = bundle["probes"]
    assert probe["format"] == "clef-local-probe/1" and probe["meta"]["seed"] == 0
    assert set(probe["checks"]["question_ids"]["intervals"]) == {"mean_abs_dp", "kl_mean", "flip_rate"}
    page = (tmp_path / "p.html").read_text()
    assert "alt='probe checks' src='data:image/png;base64," in page and "Probe:" in page
    assert "| question_order |" in (tmp_path / "p.md").read_text()
    assert main([*base, "--checks", "question_order,option_ids", "--gate", "dp<=0"]) == 1
    err = capsys.readouterr().err
    assert "gate failed: question_order: dp<=0" in err and "gate failed: option_ids: dp<=0" in err
    assert main([*base, "--gate", "flip_count<=1@upper95"]) == 2
    assert report_main(["--json", str(tmp_path / "p.json"), "--html", str(tmp_path / "again.html")]) == 0
    assert "probe checks" in (tmp_path / "again.html").read_text()
