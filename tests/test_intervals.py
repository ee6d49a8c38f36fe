"""Intervals: exact binomial bounds against closed forms, the request bootstrap against explicit resamples, and both
checked by simulation where the true value is known (~95% of 95% intervals contain it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clef_local.quality.intervals import (
    IntervalSettings,
    LabelledQuestions,
    RequestBootstrap,
    clopper_pearson,
    labelled_samples,
    percentile_interval,
)
from clef_local.quality.metrics import adaptive_ece, ece, labelled_report, macro_f1


def test_clopper_pearson_closed_forms_and_edges():
    # k = 0 and k = n have closed forms: (α/2)^(1/n)
    for n in (1, 7, 50, 500):
        low, high = clopper_pearson(0, n)
        assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-9)
        low, high = clopper_pearson(n, n)
        assert high == 1.0 and low == pytest.approx(0.025 ** (1 / n), rel=1e-9)
    low, high = clopper_pearson(5, 10)  # symmetric around 1/2
    assert low == pytest.approx(1 - high, abs=1e-12) and low == pytest.approx(0.187086, abs=1e-6)
    assert math.isnan(clopper_pearson(0, 0)[0])
    with pytest.raises(ValueError, match="0 ≤ k ≤ n"):
        clopper_pearson(3, 2)
    wider = clopper_pearson(8, 500, confidence=0.99)
    narrower = clopper_pearson(8, 500, confidence=0.90)
    assert wider[0] < narrower[0] < 8 / 500 < narrower[1] < wider[1]


def test_clopper_pearson_covers_a_known_rate_in_about_95_percent_of_runs():
    """The simulation of the issue: a flip rate of 3% on 500 questions, 4000 runs. Clopper–Pearson is exact, so it
    never covers less than its level; its conservatism keeps it near, not far above, 95%."""
    rng = np.random.default_rng(1)
    rate, n = 0.03, 500
    counts = rng.binomial(n, rate, size=4000)
    bounds = {k: clopper_pearson(int(k), n) for k in np.unique(counts)}
    covered = np.mean([bounds[k][0] <= rate <= bounds[k][1] for k in counts])
    assert 0.945 <= covered <= 0.985, covered


def _clustered(rng: np.random.Generator, requests: int, per_request: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-question values whose requests share a strong effect (as a state's questions do): true mean 1.0."""
    effect = rng.normal(0.0, 1.0, requests)
    values = 1.0 + np.repeat(effect, per_request) + rng.normal(0.0, 0.5, requests * per_request)
    return values, np.repeat(np.arange(requests), per_request)


def test_request_bootstrap_covers_a_known_mean_and_question_resampling_does_not():
    """Why the bootstrap resamples requests: with questions of one request moving together, resampling questions as
    if independent gives intervals that are far too narrow; resampling requests keeps ~95% coverage."""
    rng = np.random.default_rng(7)
    by_request = by_question = 0
    trials = 300
    for trial in range(trials):
        values, requests = _clustered(rng, 80, 4)
        settings = IntervalSettings(resamples=400, seed=trial)
        boot = RequestBootstrap(requests, settings)
        low, high = boot.interval(boot.mean(values))
        by_request += low <= 1.0 <= high
        naive = RequestBootstrap(np.arange(values.size), settings)
        low, high = naive.interval(naive.mean(values))
        by_question += low <= 1.0 <= high
    assert 0.91 <= by_request / trials <= 0.98, by_request / trials
    assert by_question / trials < 0.8, by_question / trials


def test_bootstrap_is_seeded_and_its_resamples_are_whole_requests():
    values, requests = _clustered(np.random.default_rng(0), 30, 3)
    a = RequestBootstrap(requests, IntervalSettings(resamples=200, seed=5))
    b = RequestBootstrap(requests, IntervalSettings(resamples=200, seed=5))
    c = RequestBootstrap(requests, IntervalSettings(resamples=200, seed=6))
    assert a.interval(a.mean(values)) == b.interval(b.mean(values)) != c.interval(c.mean(values))
    assert a.counts.shape == (200, 30) and np.all(a.counts.sum(axis=1) == 30)
    with pytest.raises(ValueError, match="resamples must be"):
        IntervalSettings(resamples=10)
    with pytest.raises(ValueError, match="confidence"):
        IntervalSettings(confidence=1.0)


def _expanded(boot: RequestBootstrap, b: int) -> np.ndarray:
    """Resample ``b`` of ``boot`` written out: each question repeated as often as its request was drawn."""
    return np.repeat(np.arange(boot.questions), boot.counts[b][boot.group].astype(int))


def test_resampled_metrics_equal_the_metrics_of_the_explicit_resample():
    """Each vectorised statistic on resample b is the plain metric on the questions of resample b, written out."""
    rng = np.random.default_rng(3)
    questions, k = 90, 5
    requests = np.sort(rng.integers(0, 25, questions))
    probs = rng.dirichlet(np.ones(k) * 0.6, questions)
    gold = rng.integers(0, k, questions)
    options = [[f"c{(i + j) % 7}" for j in range(k)] for i in range(questions)]  # classes by name, as B77
    boot = RequestBootstrap(requests, IntervalSettings(resamples=100, seed=2))
    labelled = LabelledQuestions.build(list(probs), list(gold), options)
    samples = labelled_samples(boot, labelled)
    for b in (0, 17, 99):
        idx = _expanded(boot, b)
        report = labelled_report([probs[i] for i in idx], [int(gold[i]) for i in idx], [options[i] for i in idx])
        for metric in ("accuracy", "macro_f1", "nll", "brier", "ece", "adaptive_ece", "confidence"):
            assert samples[metric][b] == pytest.approx(report[metric], rel=1e-9, abs=1e-12), metric
    conf, correct = labelled.confidence, labelled.correct
    idx = _expanded(boot, 5)
    assert boot.ece(conf, correct)[5] == pytest.approx(ece(conf[idx], correct[idx]))
    assert boot.adaptive_ece(conf, correct)[5] == pytest.approx(adaptive_ece(conf[idx], correct[idx]))
    assert boot.macro_f1(labelled.predicted, labelled.gold)[5] == pytest.approx(
        macro_f1([labelled.predicted[i] for i in idx], [labelled.gold[i] for i in idx]))


def test_masked_means_and_percentiles():
    boot = RequestBootstrap([0, 0, 1, 2], IntervalSettings(resamples=100, seed=0))
    values = np.array([1.0, 3.0, 10.0, 20.0])
    mask = np.array([True, True, False, False])
    means = boot.mean(values, mask)
    # only request 0 holds masked questions: every resample that draws it has mean 2, the others none
    assert np.all((means == 2.0) | np.isnan(means)) and np.isnan(means).any()
    assert percentile_interval(means) == (2.0, 2.0)
    assert all(math.isnan(v) for v in percentile_interval(np.array([np.nan])))
