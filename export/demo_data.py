"""Synthetic training requests for a joint schema head, built from real labels (BANKING77, NLU++ folds 0–15).

Clef's head learns to decide *any* schema, so its training records vary what the answer must not depend on:
question ids (random strings half the time), instruction wordings, option descriptions (present or not), option
subsets and order, and which other questions share the record. Labels come from the data only.

- BANKING77 ``train.csv``: a choice over 2–32 intents holding the gold one (the full 77 in 15% of records),
  plus noul questions "is the customer asking about <intent>?" with balanced yes/no answers.
- NLU++ banking folds: noul questions from the ontology's descriptions (multi-label truth), and a score question
  "how many of these intents does the message carry" over three listed intents (a real ordinal label).
"""

from __future__ import annotations

import random
import string
from typing import Any

from clef_local.datasets import (
    Example,
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
FULL_CHOICE = 0.15  # all 77 intents: the hardest case, but one such record costs as much as four subset records
COUNT_LEVELS = ["none of them", "exactly one of them", "exactly two of them", "all three of them"]


def _qid(rng: random.Random, readable: str, used: set[str]) -> str:
    """A readable id half the time, a random string otherwise; unique within the record."""
    while True:
        if rng.random() < 0.5:
            qid = readable if readable not in used else f"{readable}_{rng.randint(2, 99)}"
        else:
            qid = "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(3, 10)))
        if qid not in used:
            used.add(qid)
            return qid


def _choice(rng: random.Random, gold: str, intents: tuple[str, ...]) -> dict[str, Any]:
    full = rng.random() < FULL_CHOICE
    others = [i for i in intents if i != gold]
    chosen = list(intents) if full else [gold, *rng.sample(others, rng.randint(1, 31))]
    rng.shuffle(chosen)  # request order must not matter (options are sorted by id in the prompt anyway)
    describe = rng.random() < (0.2 if full else 0.5)  # descriptions make a 77-option record 2,200 tokens, not 1,700
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


def banking77_record(rng: random.Random, n: int, text: str, gold: str, intents: tuple[str, ...]) -> Example:
    used: set[str] = set()
    questions: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    kinds = ["choice"] + ["noul"] * rng.randint(0, 3)
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "choice":
            qid = _qid(rng, "intent", used)
            questions[qid], labels[qid] = _choice(rng, gold, intents), gold
        else:
            positive = rng.random() < 0.5
            intent = gold if positive else rng.choice([i for i in intents if i != gold])
            qid = _qid(rng, intent, used)
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
        qid = _qid(rng, intent, used)
        questions[qid] = _noul(rng, intents[intent])
        labels[qid] = intent in gold
    if rng.random() < 0.4:
        listed = rng.sample(names, 3)
        if positives and rng.random() < 0.5:
            listed[0] = rng.choice(positives)
        rng.shuffle(listed)
        qid = _qid(rng, "how_many", used)
        questions[qid] = {
            "type": "score", "criteria": COUNT_LEVELS,
            "instructions": "How many of these intents does the message carry: "
                            + "; ".join(intent_description(i) for i in listed) + "?"}
        labels[qid] = sum(i in gold for i in listed)
    keys = list(questions)
    rng.shuffle(keys)
    return Example(f"train-nlupp-{n}", {"model": "clef-demo", "state": text,
                                        "questions": {k: questions[k] for k in keys}}, {k: labels[k] for k in keys})


def training_examples(banking77: int = 2000, nlupp: int = 1660, seed: int = 0) -> list[Example]:
    """``banking77`` records from BANKING77 train rows, then ``nlupp`` from NLU++ folds 0–15.

    Each source draws from its own random stream, so a larger request yields the smaller one's records as its
    prefix (per source): a bigger training run reuses every cached block of a smaller one. Training shuffles.
    """
    rng = random.Random(seed)
    intents = banking77_intents()
    rows = banking77_rows("train")
    rng.shuffle(rows)
    rows = (rows * (1 + banking77 // len(rows)))[:banking77]  # past 10,003 rows: the same texts, new schemas
    examples = [banking77_record(rng, n, text, gold, intents) for n, (text, gold) in enumerate(rows)]
    nlu_rng = random.Random(seed + 1_000_003)
    nlu_intents = nlupp_intents()
    nlu_rows = nlupp_rows(range(16))
    nlu_rng.shuffle(nlu_rows)
    examples += [nlupp_record(nlu_rng, n, text, gold, nlu_intents)
                 for n, (text, gold) in enumerate((nlu_rows * (1 + nlupp // len(nlu_rows)))[:nlupp])]
    return examples
