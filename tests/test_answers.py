"""Answer shapes and confidence definitions (docs/format.md §5), on hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clef_local.runtime.answers import build_answer, choice_confidence, round_floats, score_confidence, softmax_rows
from clef_local.runtime.schema import Question


def test_choice_confidence_jev_and_reference():
    # n = 4, max p = 0.55: (0.55 - 0.25) / 0.75 = 0.4
    assert choice_confidence([0.55, 0.15, 0.2, 0.1]) == pytest.approx(0.4)
    assert choice_confidence([0.25] * 4) == pytest.approx(0.0)
    assert choice_confidence([1.0, 0.0]) == pytest.approx(1.0)
    assert choice_confidence([0.55, 0.15, 0.2, 0.1], "reference") == 0.55


def test_score_confidence_jev():
    # n = 3, uniform spread = (1 + 0 + 1) / 3; mode 2; spread = 0.2·2 + 0.3·1 = 0.7 → 1 − 0.7 / (2/3) < 0 → 0
    assert score_confidence([0.2, 0.3, 0.5]) == 0.0
    # n = 5, uniform spread = (2 + 1 + 0 + 1 + 2) / 5 = 1.2; mode 2; spread = 0.1·1 + 0.1·1 = 0.2
    assert score_confidence([0.0, 0.1, 0.8, 0.1, 0.0]) == pytest.approx(1 - 0.2 / 1.2)
    assert score_confidence([0.0, 0.0, 1.0]) == pytest.approx(1.0)
    assert score_confidence([0.0, 0.1, 0.8, 0.1, 0.0], "reference") == 0.8


def test_choice_answer_uses_request_order_and_first_tie():
    question = Question(type="choice", criteria={"zeta": None, "alpha": "a", "mid": "m"})
    # model order is sorted: alpha, mid, zeta
    answer = build_answer(question, ("alpha", "mid", "zeta"), [0.4, 0.2, 0.4])
    assert list(answer["probabilities"]) == ["zeta", "alpha", "mid"]
    assert answer["choice"] == "zeta"  # tie between zeta and alpha: first in request order
    assert answer["probabilities"]["alpha"] == pytest.approx(0.4)


def test_score_and_noul_answers():
    score = build_answer(Question(type="score", criteria=["low", "mid", "high"]), ("0", "1", "2"), [0.2, 0.3, 0.5])
    assert score["score"] == pytest.approx(0.3 + 1.0)
    assert score["legend"] == {"0": "low", "1": "mid", "2": "high"}
    assert list(score["probabilities"]) == ["0", "1", "2"]
    noul = build_answer(Question(type="noul"), ("true", "false"), [0.7, 0.3])
    assert noul == {"type": "noul", "noul": pytest.approx(0.7)}


def test_softmax_rows_ignores_padding():
    probs = softmax_rows(np.array([[0.0, math.log(3.0), -np.inf]], dtype=np.float32))
    np.testing.assert_allclose(probs, [[0.25, 0.75, 0.0]], rtol=1e-6)
    assert probs.dtype == np.float32


def test_round_floats_only_touches_floats():
    value = {"a": 0.123456, "b": [1, 0.99999, "x"], "c": {"d": True}}
    assert round_floats(value) == {"a": 0.1235, "b": [1, 1.0, "x"], "c": {"d": True}}
