"""The demo data (``train-head --data demo``): synthetic requests from real labels of training splits only
(BANKING77 ``train.csv``, NLU++ banking folds 0–15), varying what an answer must not depend on (ids, wordings,
descriptions, option subsets and order, the other questions), with twins (:func:`twin_records`) and the evaluation's
77-way records (:func:`demo_universe`). The mix: docs/demo-model.md ("How its head was trained").
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from clef_local.data.datasets import (
    Example,
    Twin,
    banking77_examples,
    banking77_intents,
    banking77_rows,
    intent_description,
    nlupp_intents,
    nlupp_rows,
)

CHOICE_INSTRUCTIONS = [
    "Which banking intent does the customer's message express?",
    "What is the customer asking about?",
    "Pick the topic of this support message.",
    "Classify the request.",
    "Route this message: which intent fits best?",
    None,
]
NOUL_TEMPLATES = [
    "Is the customer asking about {intent}?",
    "Does this message concern {intent}?",
    "Is the topic {intent}?",
    "Is the user's intent: {intent}?",
]
NEIGHBOURS = 16  # the closest intents by training-text words: the distractors a 77-way question really poses
COUNT_LEVELS = ["none of them", "exactly one of them", "exactly two of them", "all three of them"]


def question_id(rng: random.Random, readable: str, used: set[str]) -> str:
    """A readable id half the time, a random string otherwise; unique within the record."""
    while True:
        if rng.random() < 0.5:
            qid = readable if readable not in used else f"{readable}_{rng.randint(2, 99)}"
        else:
            qid = "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(3, 10)))
        if qid not in used:
            used.add(qid)
            return qid


def intent_neighbours(rows: Sequence[tuple[str, str]], k: int = NEIGHBOURS) -> dict[str, list[str]]:
    """Each intent's ``k`` nearest intents: cosine of TF-IDF word profiles of its training texts (data only)."""
    intents = sorted({gold for _, gold in rows})
    row_of = {intent: n for n, intent in enumerate(intents)}
    texts = [(re.findall(r"[a-z']+", text.lower()), gold) for text, gold in rows]  # each text tokenized once
    index = {w: n for n, w in enumerate(sorted({w for words, _ in texts for w in words}))}
    counts = np.zeros((len(intents), len(index)))
    for words, gold in texts:
        for word in words:
            counts[row_of[gold], index[word]] += 1
    profile = np.log1p(counts) * np.log(len(intents) / np.maximum((counts > 0).sum(0), 1))
    profile /= np.maximum(np.linalg.norm(profile, axis=1, keepdims=True), 1e-12)
    similarity = profile @ profile.T
    np.fill_diagonal(similarity, -np.inf)
    return {intent: [intents[j] for j in np.argsort(-similarity[n], kind="stable")[:k]]
            for n, intent in enumerate(intents)}


def _choice(rng: random.Random, gold: str, intents: tuple[str, ...], max_options: int,
            neighbours: dict[str, list[str]] | None = None, hard: float = 0.0) -> dict[str, Any]:
    """A choice over a random subset of at most ``max_options`` intents holding ``gold``; with probability ``hard``
    the distractors are drawn from ``gold``'s nearest neighbours first, the confusions a full 77-way question
    holds."""
    others = [i for i in intents if i != gold]
    size = rng.randint(1, max_options - 1)
    if neighbours and hard > 0 and rng.random() < hard:  # hard = 0 draws nothing: the old records, unchanged
        close = rng.sample(neighbours[gold], min(size, len(neighbours[gold])))
        chosen = [gold, *close, *rng.sample([i for i in others if i not in close], size - len(close))]
    else:
        chosen = [gold, *rng.sample(others, size)]
    rng.shuffle(chosen)  # request order must not matter (options are sorted by id in the prompt anyway)
    describe = rng.random() < 0.5
    question: dict[str, Any] = {"type": "choice",
                                "criteria": {i: intent_description(i) if describe else None for i in chosen}}
    if (instructions := rng.choice(CHOICE_INSTRUCTIONS)) is not None:
        question["instructions"] = instructions
    return question


def _noul(rng: random.Random, text: str) -> dict[str, Any]:
    question: dict[str, Any] = {"type": "noul", "instructions": text}
    if rng.random() < 0.2:
        question["criteria"] = {"true": "Yes.", "false": "No."}
    return question


def banking77_record(rng: random.Random, n: int, text: str, gold: str, intents: tuple[str, ...],
                     max_options: int, neighbours: dict[str, list[str]] | None = None, hard: float = 0.0
                     ) -> Example:
    used: set[str] = set()
    questions: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    kinds = ["choice"] + ["noul"] * rng.randint(0, 3)
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "choice":
            qid = question_id(rng, "intent", used)
            questions[qid], labels[qid] = _choice(rng, gold, intents, max_options, neighbours, hard), gold
        else:
            positive = rng.random() < 0.5
            intent = gold if positive else rng.choice([i for i in intents if i != gold])
            qid = question_id(rng, intent, used)
            questions[qid] = _noul(rng, rng.choice(NOUL_TEMPLATES).format(intent=intent_description(intent)))
            labels[qid] = positive
    return Example(f"train-banking77-{n}", {"model": "clef-demo", "state": text, "questions": questions}, labels)


def nlupp_record(rng: random.Random, n: int, text: str, gold: frozenset[str], intents: dict[str, str]) -> Example:
    used: set[str] = set()
    questions: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    names = list(intents)
    positives = [i for i in names if i in gold]
    negatives = [i for i in names if i not in gold]
    count = rng.randint(1, 5)
    # About half positives when the row has them, so "no" is not always right.
    picked = rng.sample(positives, min(len(positives), rng.randint(0, count))) if positives else []
    picked += rng.sample(negatives, count - len(picked))
    rng.shuffle(picked)
    for intent in picked:
        qid = question_id(rng, intent, used)
        questions[qid] = _noul(rng, intents[intent])
        labels[qid] = intent in gold
    if rng.random() < 0.4:
        listed = rng.sample(names, 3)
        if positives and rng.random() < 0.5:
            listed[0] = rng.choice(positives)
        rng.shuffle(listed)
        qid = question_id(rng, "how_many", used)
        questions[qid] = {
            "type": "score", "criteria": COUNT_LEVELS,
            "instructions": "How many of these intents does the message carry: "
                            + "; ".join(intent_description(i) for i in listed) + "?"}
        labels[qid] = sum(i in gold for i in listed)
    keys = list(questions)
    rng.shuffle(keys)
    return Example(f"train-nlupp-{n}", {"model": "clef-demo", "state": text,
                                        "questions": {k: questions[k] for k in keys}}, {k: labels[k] for k in keys})


def training_examples(banking77: int, nlupp: int, seed: int = 0, *, hard: float = 0.0, max_options: int = 12
                      ) -> list[Example]:
    """``banking77`` records from BANKING77 train rows, then ``nlupp`` from NLU++ folds 0–15.

    ``hard``: the share of BANKING77 choice questions whose distractors are the gold intent's nearest neighbours
    (:func:`intent_neighbours`); ``max_options`` caps a choice's size. Each source draws from its own random
    stream, so a larger request yields the smaller one's records as its prefix (per source): a bigger training run
    reuses every cached block of a smaller one. Training shuffles.
    """
    rng = random.Random(seed)
    intents = banking77_intents()
    rows = banking77_rows("train")
    neighbours = intent_neighbours(rows) if hard > 0 else None
    rng.shuffle(rows)
    rows = (rows * (1 + banking77 // len(rows)))[:banking77]  # past 10,003 rows: the same texts, new schemas
    examples = [banking77_record(rng, n, text, gold, intents, max_options, neighbours, hard)
                for n, (text, gold) in enumerate(rows)]
    nlu_rng = random.Random(seed + 1_000_003)
    nlu_intents = nlupp_intents()
    nlu_rows = nlupp_rows(range(16))
    nlu_rng.shuffle(nlu_rows)
    examples += [nlupp_record(nlu_rng, n, text, gold, nlu_intents)
                 for n, (text, gold) in enumerate((nlu_rows * (1 + nlupp // len(nlu_rows)))[:nlupp])]
    return examples


def demo_universe(canonical: int) -> tuple[tuple[str, ...], list[Example]]:
    """The option universe of the full views (the 77 BANKING77 intents) and the canonical records: the
    evaluation's 77-way prompt on the first ``canonical`` BANKING77 training rows (10,003: all of them; a choice
    costs only its state's pass)."""
    return banking77_intents(), banking77_examples("train", limit=canonical)


# Generic questions with no label in the data: twins teach the head to answer them the same whatever surrounds them.
# (Worded unlike the robustness benchmark's questions, which must stay held out.)
GENERIC: list[tuple[str, dict[str, Any]]] = [
    ("upset", {"type": "noul", "instructions": "Is the customer upset or frustrated?"}),
    ("has_question", {"type": "noul", "instructions": "Does the message contain a direct question?"}),
    ("money", {"type": "noul", "instructions": "Does the customer mention an amount of money?"}),
    ("polite", {"type": "noul", "instructions": "Is the message polite?",
                "criteria": {"true": "Yes.", "false": "No."}}),
    ("sentiment", {"type": "choice", "instructions": "Overall sentiment of the message?",
                   "criteria": {"positive": None, "neutral": None, "negative": None}}),
    ("area", {"type": "choice", "instructions": "Which team should handle it?",
              "criteria": {"payments": "Payments and transfers", "security": "Fraud and account security",
                           "fees": "Charges and fees", "other": "Anything else"}}),
    ("channel", {"type": "choice", "criteria": {"app": None, "branch": None, "phone": None}}),
    ("priority", {"type": "score", "instructions": "Priority of the ticket?", "criteria": ["low", "medium", "high"]}),
    ("tone", {"type": "score", "criteria": ["calm", "annoyed", "angry", "furious"]}),
    ("detail", {"type": "score", "instructions": "How detailed is the message?",
                "criteria": ["very brief", "brief", "detailed"]}),
]


ID_WORDS = ["q", "zz", "renamed", "field", "item", "Check", "x", "y", "z", "Ask", "topic", "v2"]
ID_EXTRAS = ["🙂", "é", "ß", "✓", "日本"]


def _random_id(rng: random.Random, used: set[str]) -> str:
    """A renamed id in one of the shapes clients (and the conformance suite) use: ``k3x9q``, ``zz-renamed.1``,
    ``x_y_z``, ``CheckTopic``, ``Q 🙂`` — a renaming must not move answers whatever the id looks like."""
    while True:
        style = rng.random()
        if style < 0.4:
            qid = "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(3, 10)))
        elif style < 0.7:
            words = rng.sample(ID_WORDS, rng.randint(2, 3))
            qid = rng.choice("-_.").join(words) + (f".{rng.randint(1, 9)}" if rng.random() < 0.5 else "")
        elif style < 0.85:
            qid = "".join(w.capitalize() for w in rng.sample(ID_WORDS, rng.randint(1, 3)))
        else:
            qid = f"{rng.choice(ID_WORDS).upper()} {rng.choice(ID_EXTRAS)}"
        if qid not in used:
            used.add(qid)
            return qid


def make_twin(rng: random.Random, n: int, base: Example) -> Twin:
    """``base`` plus generic questions, and its perturbed twin."""
    questions = dict(base.request["questions"])
    for name, question in rng.sample(GENERIC, rng.randint(1, 2)):
        questions[question_id(rng, name, set(questions))] = question
    keys = list(questions)
    rng.shuffle(keys)
    first = {k: questions[k] for k in keys}
    kind = rng.choice(["rename", "reorder", "add", "remove", "rename+reorder"])
    second_keys = keys[:]
    if "reorder" in kind:
        while len(second_keys) > 1 and second_keys == keys:
            rng.shuffle(second_keys)
    if kind == "remove" and len(second_keys) > 1:
        second_keys.remove(rng.choice(second_keys))
    used = set(keys)
    names = {k: (_random_id(rng, used) if "rename" in kind else k) for k in second_keys}
    second = {names[k]: first[k] for k in second_keys}
    if kind == "add":
        extra = [(question_id(rng, name, used), q) for name, q in rng.sample(GENERIC, 3) if q not in first.values()]
        items = list(second.items())
        for item in extra:
            items.insert(rng.randint(0, len(items)), item)
        second = dict(items)
    labels = {k: v for k, v in base.labels.items() if k in first}
    request = base.request
    return Twin(Example(f"twin-{n}-a", {**request, "questions": first}, labels),
                Example(f"twin-{n}-b", {**request, "questions": second},
                        {names[k]: v for k, v in labels.items() if k in names}),
                {k: names[k] for k in second_keys})


def twin_records(count: int, seed: int = 0) -> list[Twin]:
    """``count`` twins over BANKING77 and NLU++ training texts (their own random stream, prefix-stable)."""
    rng = random.Random(seed + 2_000_003)
    intents = banking77_intents()
    rows = banking77_rows("train")
    rng.shuffle(rows)
    nlu_intents = nlupp_intents()
    nlu_rows = nlupp_rows(range(16))
    rng.shuffle(nlu_rows)
    twins = []
    for n in range(count):
        if n % 3 < 2:
            text, gold = rows[n % len(rows)]
            base = banking77_record(rng, n, text, gold, intents, max_options=12)
        else:
            text, gold_set = nlu_rows[n % len(nlu_rows)]
            base = nlupp_record(rng, n, text, gold_set, nlu_intents)
        twins.append(make_twin(rng, n, base))
    return twins
