"""The sequential verdict (clef_local/quality/sequential.py): schedules, bounds, verdicts and their error rates."""

from __future__ import annotations

import json
import math
import re
import time

import numpy as np
import pytest
from scipy.stats import beta

from clef_local.quality.intervals import clopper_pearson
from clef_local.quality.sequential import (
    ALPHA,
    FIRST_LOOK,
    RequestMoments,
    Schedule,
    design_effect,
    flip_bounds,
    look,
    mean_bounds,
    schedule,
    verdict_of,
    what_would_decide,
)

INT4 = {"mean_kl": 0.03, "flip_rate": 0.05}
INT8 = {"mean_kl": 0.002, "flip_rate": 0.01}


def _questions(rng: np.random.Generator, requests: int, flip_rate: float, mean_kl: float,
               per_request: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``requests`` requests of ``per_request`` questions: gamma KL (skewed), independent flips."""
    n = requests * per_request
    kl = rng.gamma(0.5, mean_kl / 0.5, n)
    return kl, rng.random(n) < flip_rate, np.repeat(np.arange(requests), per_request)


def test_schedule_doubles_to_max_and_levels_sum_within_alpha():
    assert schedule(256).looks == (16, 32, 64, 128, 256)
    assert schedule(256, first=8).looks == (8, 16, 32, 64, 128, 256)
    assert schedule(300).looks == (16, 32, 64, 128, 300)
    assert schedule(100).looks == (16, 32, 64, 100)
    assert schedule(90).looks == (16, 32, 90)    # 64 is within 1.5× of 90: dropped
    assert schedule(5).looks == (5,)
    assert schedule(FIRST_LOOK).looks == (FIRST_LOOK,)
    for max_requests in (1, 5, 16, 17, 100, 256, 300, 1000, 1024, 4096):
        for alpha in (ALPHA, 0.01, 0.2):
            plan = schedule(max_requests, alpha=alpha)
            levels = [plan.level(k) for k in range(len(plan.looks))]
            assert sum(levels) <= alpha and all(level > 0 for level in levels)
            assert plan.looks[-1] == max_requests
    assert json.dumps(schedule(256).to_json())


def test_schedule_errors_name_the_fix():
    with pytest.raises(ValueError, match="--validation-requests"):
        schedule(0)
    with pytest.raises(ValueError, match="increasing"):
        Schedule((16, 8), ALPHA)
    with pytest.raises(ValueError, match="look 5"):
        schedule(64).level(5)


def test_flip_bounds_are_clopper_pearson_at_the_looks_level():
    plan = schedule(256)
    rng = np.random.default_rng(3)
    for k in range(len(plan.looks)):
        n = plan.looks[k]
        flipped = rng.random(n) < 0.04
        kl = rng.gamma(0.5, 0.01, n)
        result = look(plan, k, kl, flipped, np.arange(n), INT4)   # one question per request: no design effect
        bound, f = result.bounds["flip_rate"], int(flipped.sum())
        assert bound.design_effect == 1.0
        assert result.level == plan.level(k) and result.lower_level == plan.level(k) / 2
        assert bound.upper == pytest.approx(float(beta.ppf(1 - plan.level(k), f + 1, n - f)), rel=1e-12)
        assert bound.upper == pytest.approx(clopper_pearson(f, n, 1 - 2 * plan.level(k))[1], rel=1e-12)
        expected_lower = 0.0 if f == 0 else float(beta.ppf(plan.level(k) / 2, f, n - f + 1))
        assert bound.lower == pytest.approx(expected_lower, rel=1e-12, abs=1e-300)
    # flips that come together in requests: the same bound at the effective counts
    flipped = np.repeat(np.arange(40) < 6, 4)
    result = look(plan, 1, np.full(160, 0.001), flipped, np.repeat(np.arange(40), 4), INT4)
    d = result.bounds["flip_rate"].design_effect
    assert d > 1
    assert result.bounds["flip_rate"].upper == pytest.approx(
        float(beta.ppf(1 - plan.level(1), 24 / d + 1, (160 - 24) / d)), rel=1e-12)


def test_design_effect_is_one_without_clusters():
    flips = np.array([[1, 0, 0, 1, 0, 0, 0, 0]], float)
    assert design_effect(RequestMoments.of(flips, np.ones_like(flips)))[0] == pytest.approx(1.0)
    assert design_effect(RequestMoments.of(np.zeros((1, 8)), np.full((1, 8), 2.0)))[0] == 1.0


def test_mean_bounds_edge_cases():
    zero = RequestMoments.from_questions(np.zeros(10), np.repeat(np.arange(5), 2))
    lower, upper, _ = mean_bounds(zero, 0.01, 0.005)
    assert lower == 0 and upper == 0
    one = RequestMoments.from_questions(np.array([0.1, 0.2]), np.array([0, 0]))
    lower, upper, _ = mean_bounds(one, 0.01, 0.005)
    assert lower == 0 and math.isinf(upper)


def test_broken_variant_fails_at_the_first_look():
    rng = np.random.default_rng(0)
    plan = schedule(256)
    kl, flipped, request_of = _questions(rng, plan.looks[0], 0.4, 1.0)
    result = look(plan, 0, kl, flipped, request_of, INT4)
    assert result.verdict == "fail" and result.index == 0
    assert "outside" in {b.state for b in result.bounds.values()}
    assert json.loads(json.dumps(result.to_json()))["verdict"] == "fail"


def test_clean_variant_passes_before_the_last_look():
    rng = np.random.default_rng(1)
    plan = schedule(256)
    kl, flipped, request_of = _questions(rng, 256, 0.0075, 0.0005)
    verdicts = []
    for k, n in enumerate(plan.looks):
        result = look(plan, k, kl[:2 * n], flipped[:2 * n], request_of[:2 * n], INT4)
        verdicts.append(result.verdict)
        if result.verdict != "continue":
            break
    assert verdicts[-1] == "pass" and len(verdicts) < len(plan.looks)
    assert what_would_decide(result).startswith("the verdict is decided (pass)")


def test_undecided_says_what_would_decide():
    rng = np.random.default_rng(2)
    plan = schedule(64)
    kl, flipped, request_of = _questions(rng, 64, 0.008, 0.0001)   # near int8's 1% flip limit
    result = look(plan, len(plan.looks) - 1, kl, flipped, request_of, INT8)
    assert result.verdict == "undecided" and result.bounds["flip_rate"].state == "open"
    sentence = what_would_decide(result)
    asked = int(re.search(r"--validation-requests (\d+)", sentence).group(1))
    assert asked > 64 and "--validation-data FILE" in sentence
    assert look(plan, 0, kl[:32], flipped[:32], request_of[:32], INT8).verdict == "continue"


def test_bad_inputs_name_the_fix():
    plan = schedule(16)
    kl, flipped, request_of = np.full(4, 0.01), np.zeros(4, bool), np.arange(4)
    with pytest.raises(ValueError, match="mean_kl, flip_rate"):
        look(plan, 0, kl, flipped, request_of, {"max_kl": 0.1})
    with pytest.raises(ValueError, match="one entry per question"):
        look(plan, 0, kl, flipped[:3], request_of, INT4)
    with pytest.raises(ValueError, match="≥ 0"):
        look(plan, 0, -kl, flipped, request_of, INT4)


def _simulated_passes(truth: dict[str, float], limits: dict[str, float], runs: int, max_requests: int,
                      rng: np.random.Generator) -> float:
    """P(pass) of ``runs`` sequential validations (clustered flips, skewed KL shared within a request)."""
    plan = schedule(max_requests)
    m = rng.choice([1, 2, 4], p=[0.5, 0.25, 0.25], size=(runs, max_requests)).astype(float)
    p = truth["flip_rate"]
    flips = rng.binomial(m.astype(int), rng.beta(4 * p, 4 * (1 - p), size=m.shape)).astype(float)
    kl = truth["mean_kl"] * np.exp(rng.standard_normal((runs, max_requests, 1))
                                   + rng.standard_normal((runs, max_requests, 4)) - 1.0)
    kl = (kl * (np.arange(4) < m[..., None])).sum(-1)
    decided = np.full(runs, "", dtype=object)
    for k, n in enumerate(plan.looks):
        upper_level, lower_level = plan.levels(k, 2)
        flip_m, kl_m = RequestMoments.of(flips[:, :n], m[:, :n]), RequestMoments.of(kl[:, :n], m[:, :n])
        bounds = {"flip_rate": flip_bounds(flip_m.s1, flip_m.m1, upper_level, lower_level, design_effect(flip_m)),
                  "mean_kl": mean_bounds(kl_m, upper_level, lower_level)[:2]}
        now = verdict_of(bounds, limits, last=k == len(plan.looks) - 1)
        fresh = (decided == "") & (now != "continue")
        decided[fresh] = now[fresh]
    return float(np.mean(decided == "pass"))


@pytest.mark.parametrize("metric", ["flip_rate", "mean_kl"])
def test_wrong_pass_rate_at_the_limit_within_alpha(metric):
    started = time.perf_counter()
    runs = 10_000
    truth = {"flip_rate": 0.0075, "mean_kl": 0.0005, metric: INT4[metric]}
    rate = _simulated_passes(truth, INT4, runs, 128, np.random.default_rng(7))
    assert rate <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs)
    assert time.perf_counter() - started < 10
