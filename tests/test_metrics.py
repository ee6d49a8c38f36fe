"""Metrics on hand-computed examples and against scikit-learn (an independent implementation)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clef_local.quality.metrics import (
    adaptive_ece,
    brier,
    classification_report,
    ece,
    labelled_report,
    macro_f1,
    nll,
    reliability_bins,
)


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


def test_ece_bin_edges_are_right_closed():
    # 1/15 sits exactly on the first edge: it belongs to bin 0 (0, 1/15], with 0.05, not to bin 1 with 0.1
    conf = np.array([1 / 15, 0.05, 0.1])
    bins = reliability_bins(conf, np.array([1, 0, 0]))
    assert [b[2] for b in bins] == [2, 1]
    assert bins[0][0] == pytest.approx((1 / 15 + 0.05) / 2) and bins[0][1] == pytest.approx(0.5)


def test_classification_report_perfect():
    report = classification_report(np.eye(3), np.arange(3))
    assert report["accuracy"] == 1.0 and report["macro_f1"] == 1.0 and report["ece"] == pytest.approx(0.0)


def _random_case(seed: int, n: int = 300, k: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    gold = rng.integers(0, k, size=n)
    return probs, gold


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_sklearn(seed):
    from sklearn.metrics import accuracy_score, brier_score_loss, f1_score, log_loss

    probs, gold = _random_case(seed)
    pred = probs.argmax(1)
    assert macro_f1(pred.tolist(), gold.tolist(), list(range(5))) == pytest.approx(
        f1_score(gold, pred, average="macro", labels=list(range(5)), zero_division=0))
    assert nll(probs, gold) == pytest.approx(log_loss(gold, probs, labels=list(range(5))))
    # sklearn's multi-class Brier (≥1.5) is our Σ_k (p_k − y_k)² mean; binary: the positive class, half ours
    binary = probs[:, :2] / probs[:, :2].sum(1, keepdims=True)
    y = (gold % 2 == 0).astype(int)  # gold class 0 ↔ "positive" index 0
    ours = brier(binary, 1 - y)
    assert ours == pytest.approx(2 * brier_score_loss(y, binary[:, 0]))
    assert brier(probs, gold) == pytest.approx(brier_score_loss(gold, probs, labels=list(range(5))))
    report = classification_report(probs, gold)
    assert report["accuracy"] == pytest.approx(accuracy_score(gold, pred))


def test_labelled_report_matches_classification_report_on_square_input():
    probs, gold = _random_case(3, n=120, k=4)
    square = classification_report(probs, gold)
    ragged = labelled_report(list(probs), gold.tolist())
    for key in ("accuracy", "macro_f1", "nll", "brier", "ece", "adaptive_ece"):
        assert ragged[key] == pytest.approx(square[key]), key


def test_labelled_report_ragged_by_hand():
    # q1: 3 options, gold "b" predicted "b" (p 0.6); q2: 2 options, gold "a" predicted "c" (p 0.7)
    probs = [np.array([0.1, 0.6, 0.3]), np.array([0.3, 0.7])]
    report = labelled_report(probs, [1, 0], [["a", "b", "c"], ["a", "c"]])
    assert report["accuracy"] == pytest.approx(0.5)
    assert report["nll"] == pytest.approx((-math.log(0.6) - math.log(0.3)) / 2)
    assert report["brier"] == pytest.approx(((0.01 + 0.16 + 0.09) + (0.49 + 0.49)) / 2)
    # classes by name: a (tp0 fp0 fn1 → 0), b (tp1 → 1), c (fp1 → 0): macro-F1 = 1/3
    assert report["macro_f1"] == pytest.approx(1 / 3)
    # two bins: conf 0.6 correct → 0.4 · 1/2; conf 0.7 wrong → 0.7 · 1/2
    assert report["ece"] == pytest.approx(0.55)
