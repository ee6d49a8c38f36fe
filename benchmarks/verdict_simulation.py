"""The sequential verdict's error rates and requests used, by simulation (clef_local/quality/sequential.py).

    python benchmarks/verdict_simulation.py                      # 10,000 validations per scenario
    python benchmarks/verdict_simulation.py --runs 2000 --max-requests 256

Each simulated validation draws a variant with known true values and runs the verdict exactly as
:func:`clef_local.quality.sequential.look` does (its public bound functions, vectorized over the runs), look after
look, stopping at the first ``pass`` or ``fail``:

- **Requests**: questions per request drawn from the packaged probe set's mix (:func:`clef_local.export.validate.
  validation_requests`: half 1 question, a quarter 4, a quarter 2), in a shuffled order.
- **KL per question**: lognormal with the scenario's mean, skewed and shared within a request:
  ``log KL = log μ − (σ_r² + σ_q²)/2 + σ_r·Z_request + σ_q·Z_question`` (σ_r = σ_q = 1 by default: a question's
  KL has a coefficient of variation of ~2.5; ``--tail 1.5`` makes the request effect heavier).
- **Flips clustered by request**: each request's flip probability ~ Beta(p·c, (1 − p)·c) with c = 4 (an
  intra-request correlation of 0.2), its flips ~ Binomial(questions, that probability); the true flip rate is p.

Scenarios per scheme (int4/nf4's limits and int8/fp8's): a good variant, a broken one, the flip rate at 0.25×–2× its
limit (mean KL good) and the mean KL at 0.25×–2× its limit (flip rate good). "wrong pass" is P(pass) where a true
value is over its limit (at exactly 1× it is the supremum over values just above); "wrong refusal" is P(fail)
where every true value is within. Both must be ≤ alpha. Table in docs/benchmarks.md#the-verdicts-error-rates.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from clef_local.export.validate import validation_requests
from clef_local.quality.sequential import (
    ALPHA,
    FIRST_LOOK,
    RequestMoments,
    design_effect,
    flip_bounds,
    mean_bounds,
    schedule,
    verdict_of,
)

LIMITS = {"int4": {"mean_kl": 0.03, "flip_rate": 0.05}, "int8": {"mean_kl": 0.002, "flip_rate": 0.01}}
# what a good variant measures (the brief's int4; int8's KL assumed 5% of its limit)
GOOD = {"int4": {"mean_kl": 0.0005, "flip_rate": 0.0075}, "int8": {"mean_kl": 0.0001, "flip_rate": 0.001}}
BROKEN = {"mean_kl": 1.0, "flip_rate": 0.4}
MULTIPLES = (0.25, 0.5, 0.8, 1.0, 1.25, 2.0)
# the max_requests the scenarios around each limit run at (the good and broken rows run at every --max-requests)
SCENARIO_MAX = {"int4": 256, "int8": 1024}
CLUSTER = 4.0  # Beta concentration of a request's flip probability: intra-request correlation 1/(c+1)
MAX_Q = 4      # the most questions a probe request has


@dataclass(frozen=True)
class Scenario:
    scheme: str
    name: str
    truth: dict[str, float]


def scenarios(schemes: list[str]) -> list[Scenario]:
    out = []
    for scheme in schemes:
        limits, good = LIMITS[scheme], GOOD[scheme]
        out.append(Scenario(scheme, "good", dict(good)))
        out.append(Scenario(scheme, "broken", dict(BROKEN)))
        for metric in ("flip_rate", "mean_kl"):
            for m in MULTIPLES:
                out.append(Scenario(scheme, f"{metric} {m:g}× limit", {**good, metric: m * limits[metric]}))
    return out


def question_mix(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The packaged probe set's questions per request and their shares."""
    counts = Counter(len(r["questions"]) for r in validation_requests(n))
    sizes = np.array(sorted(counts), dtype=np.int64)
    return sizes, np.array([counts[s] for s in sizes], dtype=np.float64) / n


def simulate(truth: dict[str, float], runs: int, n: int, mix: tuple[np.ndarray, np.ndarray],
             rng: np.random.Generator, tail: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-request question counts, flips and KL sums of ``runs`` validations of ``n`` requests ([runs, n] each)."""
    sizes, shares = mix
    m = rng.choice(sizes, size=(runs, n), p=shares)
    p = truth["flip_rate"]
    p_r = rng.beta(p * CLUSTER, (1 - p) * CLUSTER, size=(runs, n))
    flips = rng.binomial(m, p_r)
    sr, sq = tail, 1.0
    log_kl = (math.log(truth["mean_kl"]) - (sr ** 2 + sq ** 2) / 2 + sr * rng.standard_normal((runs, n, 1))
              + sq * rng.standard_normal((runs, n, MAX_Q)))
    kl = np.exp(log_kl.astype(np.float32)) * (np.arange(MAX_Q) < m[..., None])
    return m.astype(np.float64), flips.astype(np.float64), kl.sum(-1, dtype=np.float64)


def run_verdicts(m: np.ndarray, flips: np.ndarray, kl: np.ndarray, limits: dict[str, float], max_requests: int,
                 alpha: float, first: int) -> tuple[np.ndarray, np.ndarray]:
    """The verdict each run reaches and the requests it used, on the first ``max_requests`` of its requests."""
    plan = schedule(max_requests, first=first, alpha=alpha)
    runs = m.shape[0]
    verdict = np.full(runs, "", dtype=object)
    used = np.zeros(runs, dtype=np.int64)
    cum_m, cum_f = np.cumsum(m, axis=1), np.cumsum(flips, axis=1)
    for k, n in enumerate(plan.looks):
        upper_level, lower_level = plan.levels(k, len(limits))
        deff = design_effect(RequestMoments.of(flips[:, :n], m[:, :n]))
        flip_lo, flip_up = flip_bounds(cum_f[:, n - 1], cum_m[:, n - 1], upper_level, lower_level, deff)
        kl_lo, kl_up, _ = mean_bounds(RequestMoments.of(kl[:, :n], m[:, :n]), upper_level, lower_level)
        now = verdict_of({"flip_rate": (flip_lo, flip_up), "mean_kl": (kl_lo, kl_up)}, limits,
                         last=k == len(plan.looks) - 1)
        fresh = (verdict == "") & (now != "continue")
        verdict[fresh] = now[fresh]
        used[fresh] = n
    return verdict.astype(str), used


def error_cell(truth: dict[str, float], limits: dict[str, float], p_pass: float, p_fail: float, runs: int,
               alpha: float) -> str:
    """The error this scenario can make, its rate ± one standard error, and whether it is within ``alpha``."""
    over = any(truth[k] > limits[k] * (1 + 1e-9) for k in limits)
    at = any(abs(truth[k] - limits[k]) <= 1e-9 * limits[k] for k in limits)
    cells = []
    for name, rate, applies in (("wrong pass", p_pass, over or at), ("wrong refusal", p_fail, not over)):
        if applies:
            se = math.sqrt(max(rate * (1 - rate), 1 / runs) / runs)
            cells.append(f"{name} {rate:.2%} ± {se:.2%} {'≤' if rate <= alpha else '>'} {alpha:.0%}")
    return "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10_000, help="simulated validations per scenario (10,000)")
    parser.add_argument("--max-requests", default="128,256,512,1024",
                        help="max_requests of the good and broken rows (comma-separated); the rows around a limit "
                             f"run at {SCENARIO_MAX}")
    parser.add_argument("--first", type=int, default=FIRST_LOOK, help=f"requests at the first look ({FIRST_LOOK})")
    parser.add_argument("--only", help="run only the scenarios whose name contains this (e.g. broken)")
    parser.add_argument("--schemes", default="int4,int8", help="whose limits (int4 = nf4's, int8 = fp8's)")
    parser.add_argument("--alpha", type=float, default=ALPHA)
    parser.add_argument("--tail", type=float, default=1.0, help="σ of the request effect on log KL (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=2000, help="runs simulated at once (memory)")
    args = parser.parse_args(argv)
    maxes = [int(v) for v in args.max_requests.split(",")]
    mix = question_mix(max(*maxes, *SCENARIO_MAX.values()))
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    mean_q = float((mix[0] * mix[1]).sum())
    shares = dict(zip(mix[0].tolist(), mix[1].round(3).tolist(), strict=True))
    print(f"{args.runs:,} simulated validations per row; questions per request: share {shares}"
          f" (mean {mean_q:.2f}); KL lognormal σ_request {args.tail:g}, σ_question 1; flips clustered "
          f"(Beta, c = {CLUSTER:g}); alpha {args.alpha:g}; first look {args.first} requests, doubling\n", flush=True)
    print("| scheme | scenario | true flip rate | true mean KL | max requests | P(pass) | P(fail) | P(undecided) "
          "| mean requests used | error vs alpha |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for sc in scenarios(args.schemes.split(",")):
        if args.only and args.only not in sc.name:
            continue
        limits = LIMITS[sc.scheme]
        for max_requests in maxes if sc.name in ("good", "broken") else [SCENARIO_MAX[sc.scheme]]:
            tally = Counter()
            used_sum = 0
            for start in range(0, args.runs, args.chunk):
                size = min(args.chunk, args.runs - start)
                verdict, used = run_verdicts(*simulate(sc.truth, size, max_requests, mix, rng, args.tail), limits,
                                             max_requests, args.alpha, args.first)
                tally.update(verdict.tolist())
                used_sum += int(used.sum())
            p = {v: tally[v] / args.runs for v in ("pass", "fail", "undecided")}
            print(f"| {sc.scheme} | {sc.name} | {sc.truth['flip_rate']:.4g} | {sc.truth['mean_kl']:.4g} | "
                  f"{max_requests} | {p['pass']:.2%} | {p['fail']:.2%} | {p['undecided']:.2%} | "
                  f"{used_sum / args.runs:.1f} | "
                  f"{error_cell(sc.truth, limits, p['pass'], p['fail'], args.runs, args.alpha)} |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
