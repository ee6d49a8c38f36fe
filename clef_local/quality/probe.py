"""Metamorphic robustness checks: change a request in a way that must not change its answers, run both, compare.

Each check (:data:`CHECKS`) rewrites a request (:func:`transform`) and records how the rewritten request's questions
and options map back onto the original's, so every option's probability is compared with its own original
(renamed options are read back under their original ids). Per check: the mean over questions of the largest
|Δp| of an option (bootstrap interval over requests), the mean KL(original ‖ rewritten), and the share of
flipped decisions (exact binomial interval). A request a check cannot change (one question for ``question_order``,
no choice question for ``option_order``) is left out of that check. The rewrites are drawn from a seeded
generator: the same seed, the same rewritten requests. docs/quality.md#probe.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from clef_local.quality.drift import question_drift, state_snippet
from clef_local.quality.intervals import DEFAULT_INTERVALS, IntervalSettings, RequestBootstrap, as_list, clopper_pearson
from clef_local.quality.results import ProbeResult
from clef_local.runtime.schema import QUESTION_TYPES

if TYPE_CHECKING:
    from clef_local.model import ClefModel, Prediction

DESCRIPTIONS = {
    "option_order": "a choice's options listed in another order",
    "question_order": "the questions asked in another order",
    "question_ids": "every question id renamed (the instructions kept)",
    "option_ids": "every choice option id renamed, its description kept",
    "irrelevant_context": "an unrelated sentence added to the state",
    "state_format": "a text state sent as a JSON object, a JSON state as text lines",
}
CHECKS = tuple(DESCRIPTIONS)
IRRELEVANT = (
    "The office kitchen was repainted last spring.",
    "It rained for most of the afternoon.",
    "The train to the coast leaves every hour.",
    "A new bakery opened two streets away.",
    "The museum is closed on public holidays.",
    "Someone left an umbrella in the lobby.",
)
STATE_KEY = "message"  # a text state sent as JSON: {"message": text}
WORST = 5  # largest moves kept per check


@dataclass(frozen=True)
class Transformed:
    """A rewritten request and how it maps back: rewritten question id → original id, and per original question,
    rewritten option id → original option id (only where options were renamed)."""

    request: dict[str, Any]
    questions: dict[str, str]
    options: dict[str, dict[str, str]] = field(default_factory=dict)


def _identity(request: Mapping[str, Any]) -> dict[str, str]:
    return {str(q): str(q) for q in request["questions"]}


def _shuffled(items: list[Any], rng: random.Random) -> list[Any]:
    """A permutation of ``items`` other than the identity (for two or more items)."""
    if len(items) < 2:
        return list(items)
    while True:
        out = list(items)
        rng.shuffle(out)
        if out != items:
            return out


def _token(rng: random.Random, prefix: str, taken: set[str]) -> str:
    while (name := prefix + "".join(rng.choice(string.ascii_lowercase) for _ in range(6))) in taken:
        pass
    taken.add(name)
    return name


def _option_order(request: dict[str, Any], rng: random.Random) -> Transformed | None:
    questions, changed = {}, False
    for qid, question in request["questions"].items():
        criteria = question.get("criteria")
        if question.get("type") == "choice" and isinstance(criteria, dict) and len(criteria) > 1:
            question = {**question, "criteria": dict(_shuffled(list(criteria.items()), rng))}
            changed = True
        questions[qid] = question
    return Transformed({**request, "questions": questions}, _identity(request)) if changed else None


def _question_order(request: dict[str, Any], rng: random.Random) -> Transformed | None:
    items = list(request["questions"].items())
    if len(items) < 2:
        return None
    return Transformed({**request, "questions": dict(_shuffled(items, rng))}, _identity(request))


def _question_ids(request: dict[str, Any], rng: random.Random) -> Transformed | None:
    taken = {str(q) for q in request["questions"]}
    questions, back = {}, {}
    for qid, question in request["questions"].items():
        new = _token(rng, "field_", taken)
        # a question without instructions is asked by its id: keep that text when the id changes
        if not question.get("instructions"):
            question = {**question, "instructions": str(qid)}
        questions[new], back[new] = question, str(qid)
    return Transformed({**request, "questions": questions}, back)


def _option_ids(request: dict[str, Any], rng: random.Random) -> Transformed | None:
    questions, options = {}, {}
    for qid, question in request["questions"].items():
        criteria = question.get("criteria")
        if question.get("type") == "choice" and isinstance(criteria, dict):
            taken = {str(k) for k in criteria}
            renamed, back = {}, {}
            for option, description in criteria.items():
                new = _token(rng, "opt_", taken)
                renamed[new] = str(option) if description is None else description
                back[new] = str(option)
            question = {**question, "criteria": renamed}
            options[str(qid)] = back
        questions[qid] = question
    return Transformed({**request, "questions": questions}, _identity(request), options) if options else None


def _irrelevant_context(request: dict[str, Any], rng: random.Random) -> Transformed | None:
    state, sentence = request["state"], rng.choice(IRRELEVANT)
    if isinstance(state, str):
        new: Any = f"{state}\n\n{sentence}"
    elif isinstance(state, dict):
        new = {**state, _token(rng, "note_", set(map(str, state))): sentence}
    elif isinstance(state, list):
        new = [*state, sentence]
    else:
        return None
    return Transformed({**request, "state": new}, _identity(request))


def _state_format(request: dict[str, Any], rng: random.Random) -> Transformed | None:
    from clef_local.runtime.encoding import render

    state = request["state"]
    if isinstance(state, str):
        new: Any = {STATE_KEY: state}
    elif isinstance(state, dict) and state:
        new = "\n".join(f"{key}: {render(value)}" for key, value in state.items())
    else:
        return None
    return Transformed({**request, "state": new}, _identity(request))


TRANSFORMS: dict[str, Callable[[dict[str, Any], random.Random], Transformed | None]] = {
    "option_order": _option_order, "question_order": _question_order, "question_ids": _question_ids,
    "option_ids": _option_ids, "irrelevant_context": _irrelevant_context, "state_format": _state_format,
}


def transform(check: str, request: Mapping[str, Any], rng: random.Random) -> Transformed | None:
    """``request`` rewritten by ``check`` (None: the check cannot change it)."""
    if check not in TRANSFORMS:
        raise ValueError(f"unknown probe check {check!r}; known: {', '.join(CHECKS)}")
    return TRANSFORMS[check](dict(request), rng)


def check_rng(seed: int, check: str) -> random.Random:
    """The generator of one check's rewrites: the same for the same seed, whatever other checks run."""
    return random.Random(f"{seed}:{check}")


def mapped_back(original: Prediction, rewritten: Prediction, how: Transformed) -> list[np.ndarray]:
    """The rewritten prediction's probabilities per original question, in the original's option order."""
    by_original = {}
    for question, p in zip(rewritten.encoded.questions, rewritten.probabilities, strict=True):
        qid = how.questions[question.question_id]
        names = how.options.get(qid)
        ids = [names[o] if names else o for o in question.option_ids]
        by_original[qid] = dict(zip(ids, (float(x) for x in p[: len(ids)]), strict=True))
    return [np.array([by_original[q.question_id][o] for o in q.option_ids]) for q in original.encoded.questions]


@dataclass
class _Collected:
    requests: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    dp: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    flipped: list[bool] = field(default_factory=list)
    worst: list[dict[str, Any]] = field(default_factory=list)


def _summary(check: str, got: _Collected, settings: IntervalSettings) -> dict[str, Any]:
    n = len(got.dp)
    entry: dict[str, Any] = {"description": DESCRIPTIONS[check], "requests": len(set(got.requests)), "questions": n}
    if not n:
        return {**entry, "mean_abs_dp": None, "kl_mean": None, "max_abs_dp": None, "flips": 0, "flip_rate": None,
                "intervals": {}}
    boot = RequestBootstrap(got.requests, settings)
    flips = int(sum(got.flipped))
    return {**entry, "mean_abs_dp": float(np.mean(got.dp)), "kl_mean": float(np.mean(got.kl)),
            "max_abs_dp": float(np.max(got.dp)), "flips": flips, "flip_rate": flips / n,
            "by_type": {k: int(sum(1 for x in got.kinds if x == k)) for k in QUESTION_TYPES if k in got.kinds},
            "intervals": {"mean_abs_dp": as_list(boot.interval(boot.mean(np.array(got.dp)))),
                          "kl_mean": as_list(boot.interval(boot.mean(np.array(got.kl)))),
                          "flip_rate": as_list(clopper_pearson(flips, n, settings.confidence))}}


def run_probe(model: ClefModel, requests: Sequence[Mapping[str, Any]], *, checks: Sequence[str] = CHECKS,
              seed: int = 0, batch_size: int = 8, settings: IntervalSettings = DEFAULT_INTERVALS,
              data_name: str = "", progress: Callable[[int, int], None] | None = None) -> ProbeResult:
    """Every check of ``checks`` on ``requests``: one pass of the originals, one of each check's rewrites.
    ``progress(done, total)`` counts requests over all passes."""
    unknown = [c for c in checks if c not in TRANSFORMS]
    if unknown:
        raise ValueError(f"unknown probe check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    rewrites = {c: [(n, t) for n, r in enumerate(requests) if (t := transform(c, r, check_rng(seed, c)))]
                for c in checks}
    total = len(requests) + sum(len(v) for v in rewrites.values())
    done = 0

    def step(d: int, _t: int) -> None:
        if progress is not None:
            progress(done + d, total)

    base = model.predict(list(requests), batch_size=batch_size, progress=step)
    done += len(requests)
    results, worst = {}, {}
    for check in checks:
        got = _Collected()
        changed = model.predict([t.request for _, t in rewrites[check]], batch_size=batch_size, progress=step)
        done += len(rewrites[check])
        for (n, how), pred in zip(rewrites[check], changed, strict=True):
            original = base[n]
            for question, p, q in zip(original.encoded.questions, original.probabilities,
                                      mapped_back(original, pred, how), strict=True):
                kind = QUESTION_TYPES[question.question_type]
                d = question_drift(p[: len(question.option_ids)], q, kind)
                got.requests.append(n)
                got.kinds.append(kind)
                got.dp.append(d.max_abs)
                got.kl.append(d.kl)
                got.flipped.append(d.flipped)
                got.worst.append({"request": n, "question": question.question_id, "kind": kind, "dp": d.max_abs,
                                  "flipped": d.flipped, "state": state_snippet(original.request.state)})
        results[check] = _summary(check, got, settings)
        worst[check] = sorted(got.worst, key=lambda w: (w["flipped"], w["dp"]), reverse=True)[:WORST]
    return ProbeResult(model=str(model.path), data=data_name, requests=len(requests), checks=results, worst=worst,
                       meta={"seed": seed, "intervals": settings.to_json()})
