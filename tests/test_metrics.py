"""Metrics on hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clef_local.metrics import adaptive_ece, brier, classification_report, ece, macro_f1, nll


def test_macro_f1_by_hand():
    # class a: tp 1, fp 1, fn 0 → 2/3; class b: tp 1, fp 0, fn 1 → 2/3; class c: tp 0, fp 0, fn 0 → 0
    assert macro_f1(["a", "a", "b"], ["a", "b", "b"], ["a", "b"]) == pytest.approx(2 / 3)
    assert macro_f1(["a", "a", "b"], ["a", "b", "b"], ["a", "b", "c"]) == pytest.approx(4 / 9)


def test_nll_and_brier():
    probs = np.array([[0.5, 0.5], [0.9, 0.1]])
    gold = np.array([0, 1])
    assert nll(probs, gold) == pytest.approx((-math.log(0.5) - math.log(0.1)) / 2)
    assert brier(probs, gold) == pytest.approx(((0.25 + 0.25) + (0.81 + 0.81)) / 2)


def test_ece_bins():
    # two bins used: conf 0.95 (2 rows, 1 correct) → |0.5 − 0.95| · 2/4; conf 0.55 (2 rows, both correct) → 0.45 · 2/4
    confidence = np.array([0.95, 0.95, 0.55, 0.55])
    correct = np.array([1, 0, 1, 1])
    assert ece(confidence, correct) == pytest.approx(0.5 * 0.45 + 0.5 * 0.45)
    assert ece(np.array([1.0, 0.0]), np.array([1, 0])) == pytest.approx(0.0)
    assert adaptive_ece(confidence, correct, bins=2) == pytest.approx(0.5 * 0.45 + 0.5 * 0.45)


def test_classification_report_perfect():
    report = classification_report(np.eye(3), np.arange(3))
    assert report["accuracy"] == 1.0 and report["macro_f1"] == 1.0 and report["ece"] == pytest.approx(0.0)
