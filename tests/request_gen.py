"""Deterministic, varied SystemOne requests for parity tests (unicode, JSON states, edge-size schemas)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

STATES: list[Any] = [
    "I was charged twice for the same coffee this morning.",
    "Mon virement n'est jamais arrivé 😡 — pouvez-vous vérifier ?",
    "转账失败了，请帮我查一下。",
    {"customer": "Ana", "messages": ["card declined", "at the airport"], "vip": True, "balance": -12.5},
    ["first line", {"nested": None, "n": 3}, 7, False],
    "",
    "Emoji only: 🚀🔥💳🏦",
    {"b": 1, "a": {"z": "last", "y": "ünïcødé"}},
    "x" * 300,
    "Line one\nLine two\n\tTabbed \"quoted\" text with <|im_end|> inside",
]
IDS = ["q1", "urgency", "質問_1", "🔥", "needs human?", "a b c", "ID-0042", "état", "x", "Q"]
INSTRUCTIONS: list[Any] = [
    "Is the customer angry?",
    None,
    "",
    {"ask": "Which department?", "hint": ["billing", "cards"]},
    ["Rate", "the", "urgency"],
    "Décidez : est-ce une fraude ? 🕵️",
]
LABELS = ["billing", "cards", "transfers", "Other", "10", "2", "b", "a", "C", "🏦 bank", "ünïcode", "zeta"]


def _question(rng: random.Random, kind: str) -> dict[str, Any]:
    q: dict[str, Any] = {"type": kind}
    instructions = rng.choice(INSTRUCTIONS)
    if instructions is not None or rng.random() < 0.5:
        q["instructions"] = instructions
    if kind == "noul":
        override = rng.choice([None, {}, {"true": "Yes, clearly."}, {"false": None},
                               {"true": None, "false": "Not at all."}])
        if override is not None:
            q["criteria"] = override
    elif kind == "choice":
        labels = rng.sample(LABELS, rng.randint(2, 6))
        q["criteria"] = {label: rng.choice([None, f"Means {label}", "Descripción 📎"]) for label in labels}
    else:
        q["criteria"] = [f"level {i} {rng.choice(['low', 'mid', 'high', '⚡'])}" for i in range(rng.randint(2, 10))]
    return q


def varied_requests(n: int = 40, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` requests (n ≥ 4): random mixes plus fixed edge cases (1 question, 64 questions, 255 options)."""
    rng = random.Random(seed)
    requests: list[dict[str, Any]] = []
    for i in range(n - 3):
        count = rng.randint(1, 6)
        ids = rng.sample(IDS, count)
        questions = {qid: _question(rng, rng.choice(["noul", "choice", "score"])) for qid in ids}
        requests.append({"model": "clef-test", "state": STATES[i % len(STATES)], "questions": questions})
    requests.append({"model": "clef-test", "state": "one question",
                     "questions": {"only": {"type": "noul"}}})
    requests.append({"model": "clef-test", "state": STATES[3],
                     "questions": {f"q{i}": _question(rng, ["noul", "choice", "score"][i % 3]) for i in range(64)}})
    requests.append({"model": "clef-test", "state": STATES[1], "questions": {
        "intent": {"type": "choice", "instructions": "Pick the intent",
                   "criteria": {f"intent_{i:03d}": (None if i % 7 == 0 else f"intent number {i}")
                                for i in rng.sample(range(255), 255)}},
        "ok": {"type": "noul"}}})
    return requests


def random_questions(rng: random.Random, count: int) -> dict[str, Any]:
    """``count`` random questions (ids from :data:`IDS` first, then ``qN``), of every type, for varied schemas."""
    ids = rng.sample(IDS, min(count, len(IDS))) + [f"q{i}" for i in range(len(IDS), count)]
    return {qid: _question(rng, rng.choice(["noul", "choice", "score"])) for qid in ids}


def shared_state_requests(states: list[Any], schemas: int, seed: int = 0) -> list[dict[str, Any]]:
    """``schemas`` different random schemas (1-5 questions) on each state, state after state: what a state cache
    sees when several question sets are asked about one ticket."""
    rng = random.Random(seed)
    return [{"model": "clef-test", "state": state, "questions": random_questions(rng, rng.randint(1, 5))}
            for state in states for _ in range(schemas)]


def max_dp(a: list[Any], b: list[Any]) -> float:
    """The largest probability difference between two runs' predictions (``ClefModel.predict``) of the same
    requests, over every question."""
    return max(float(np.abs(x - y).max()) for p, q in zip(a, b, strict=True)
               for x, y in zip(p.probabilities, q.probabilities, strict=True))


LONG_WORDS = (
    "the", "card", "was", "declined", "again", "at", "the", "store", "and", "nobody", "could", "tell", "me", "why",
    "so", "I", "called", "the", "bank", "twice", "refund", "my", "money", "please", "this", "is", "the", "third",
    "time", "my", "transfer", "failed", "the", "balance", "looks", "wrong", "Überweisung", "été", "转账", "😀",
)
LONG_QUESTIONS: dict[str, Any] = {
    "intent": {"type": "choice", "instructions": "What does the customer want?",
               "criteria": {"refund": "Money back", "card": "A card problem", "other": None}},
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
}


def long_state(chars: int, seed: int = 0) -> str:
    """Random sentences of :data:`LONG_WORDS`, at least ``chars`` characters: a state of tens of thousands of
    tokens (cut to an exact length with ``truncate_state``)."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(LONG_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def continued(model: Any, requests: list[Any], state: Any) -> Any:
    """The torch pass's hidden states ``[rows, longest, hidden]`` of ``requests`` (one state, told apart by their
    schemas) continued from ``state``, a ``TorchState`` put in a fresh state cache under their state's key."""
    from clef_local.backends.torch_pass import collate, hidden_states
    from clef_local.runtime.state_cache import StateCache, record_state_key

    backbone, identity, pad = model.backend.backbone, model.backend.state_identity, model.tokenizer.pad_token_id
    records = [model.encode(r) for r in requests]
    cache = StateCache(1 << 34)
    assert cache.put(record_state_key(identity, records[0]), state)
    ids, mask = collate(records, pad, backbone.device)
    hidden = hidden_states(backbone, records, ids, mask, pad, cache=cache, identity=identity)
    assert cache.stats().hits == len(records)  # every row continued the state: none ran it again
    return hidden
