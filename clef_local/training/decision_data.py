"""Synthetic decision requests over every labelled source clef-local ships (clef_local/data/README.md), for
``train-head --adapters`` (:mod:`.adapter_train`): BANKING77, NLU++, VADER and the severity ladders as choices,
nouls (some negated) and scores, worded several ways, with twins. Every label comes from data, never from a model;
the mix: docs/demo-model.md ("Adapters on the backbone").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clef_local.data.datasets import (
    BANKING77_INSTRUCTIONS,
    Example,
    Twin,
    banking77_intents,
    banking77_rows,
    intent_description,
    nlupp_intents,
    nlupp_rows,
)
from clef_local.data.sources import Ladder, severity_domains, severity_ladders, vader_words
from clef_local.training.demo_data import (
    CHOICE_INSTRUCTIONS,
    COUNT_LEVELS,
    NOUL_TEMPLATES,
    intent_neighbours,
    make_twin,
    question_id,
)

NEGATED_INTENT = [
    "Is the customer NOT asking about {intent}?",
    "Is it false that this message concerns {intent}?",
    "Is the message about something other than {intent}?",
]
SEVERITY_QUESTIONS = [
    "How severe is the problem described?",
    "How serious is this situation?",
    "How bad is the customer's problem?",
    "Rate the severity of the issue.",
]
URGENCY_QUESTIONS = [
    "How urgent is this message?",
    "How quickly does this need a response?",
    "Rate the urgency of the request.",
]
SEVERITY_LEVELS = {
    3: [["low", "medium", "high"], ["minor", "moderate", "severe"]],
    4: [["minor", "moderate", "serious", "critical"], ["low", "medium", "high", "emergency"]],
    5: [["trivial", "minor", "moderate", "serious", "critical"], ["1", "2", "3", "4", "5"]],
    10: [[str(n) for n in range(1, 11)]],
}
EMERGENCY_QUESTIONS = ["Is this an emergency?", "Is someone in danger or facing serious loss right now?",
                       "Does this need immediate action?"]
ROUTING_QUESTIONS = ["Which team should handle this message?", "Route the message to a department.",
                     "Which area does this message belong to?", None]
POLARITY_QUESTIONS = ["How positive or negative is the message?", "What is the sentiment of the message?"]
POLARITY_LEVELS = [["very negative", "negative", "neutral", "positive", "very positive"],
                   ["angry", "unhappy", "neutral", "pleased", "delighted"]]
STRENGTH_QUESTIONS = ["How strong is the emotion in the message?", "How intense is the feeling expressed?"]
STRENGTH_LEVELS = [["mild", "clear", "strong"], ["weak", "moderate", "intense"]]
POSITIVE_QUESTIONS = ["Is the message positive?", "Is the customer happy?", "Does the writer feel good about it?"]
NEGATIVE_QUESTIONS = ["Is the message negative?", "Is the customer unhappy?", "Is the writer upset?"]
NOT_POSITIVE = ["Is the message not positive?", "Is the customer not happy?"]
NOT_NEGATIVE = ["Is the message not negative?", "Is the writer not upset?"]
# A message that ends in a rated word: the word carries the sentiment, whatever its part of speech.
VADER_TEMPLATES = ["One word for my experience: {word}.", "{text} In a word: {word}.",
                   "My feeling about this: {word}.", "{text} Honestly, {word}."]
OPENERS = ["", "", "Hi, ", "Hello. ", "Please help. ", "Good morning, "]


@dataclass(frozen=True)
class DecisionMix:
    """Shares of each record kind (they need not sum to 1; they are normalised)."""

    banking77: float = 0.25
    full_choice: float = 0.06  # the 77-way choice alone (the evaluation's question; ~1,670 tokens a record)
    nlupp: float = 0.22
    sentiment: float = 0.17
    severity: float = 0.2
    twins: float = 0.35  # share of records that also get a perturbed twin


def _level(rank: int, top: int, levels: int) -> int:
    """Rank ``rank`` of ``0..top`` mapped onto ``levels`` ordered levels."""
    return round(rank * (levels - 1) / top)


def _noul(text: str, rng: random.Random) -> dict[str, Any]:
    question: dict[str, Any] = {"type": "noul", "instructions": text}
    if rng.random() < 0.15:
        question["criteria"] = {"true": "Yes.", "false": "No."}
    return question


def _score(instructions: str | None, levels: Sequence[str]) -> dict[str, Any]:
    question: dict[str, Any] = {"type": "score", "criteria": list(levels)}
    if instructions is not None:
        question["instructions"] = instructions
    return question


class Generator:
    """Draws records of every kind from one random stream (``seed``): the same seed, the same records."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.intents = banking77_intents()
        self.b77 = banking77_rows("train")
        self.neighbours = intent_neighbours(self.b77)
        self.nlu_intents = nlupp_intents()
        self.nlu = nlupp_rows(range(16))
        self.words = vader_words()
        self.ladders = severity_ladders("train")
        self.domains = severity_domains()

    # -- one record per kind ------------------------------------------------------------------------------------
    def banking77(self, n: int) -> Example:
        rng = self.rng
        text, gold = rng.choice(self.b77)
        used: set[str] = set()
        questions: dict[str, Any] = {}
        labels: dict[str, Any] = {}
        size = rng.randint(1, 11)
        close = [i for i in self.neighbours[gold] if rng.random() < 0.5][:size]
        others = [i for i in self.intents if i != gold and i not in close]
        chosen = [gold, *close, *rng.sample(others, size - len(close))]
        rng.shuffle(chosen)
        describe = rng.random() < 0.4
        choice: dict[str, Any] = {"type": "choice",
                                  "criteria": {i: intent_description(i) if describe else None for i in chosen}}
        if (instructions := rng.choice(CHOICE_INSTRUCTIONS)) is not None:
            choice["instructions"] = instructions
        kinds = ["choice"] + ["noul"] * rng.randint(0, 1)
        rng.shuffle(kinds)
        for kind in kinds:
            if kind == "choice":
                qid = question_id(rng, "intent", used)
                questions[qid], labels[qid] = choice, gold
                continue
            positive = rng.random() < 0.5
            intent = gold if positive else rng.choice([*self.neighbours[gold][:4], rng.choice(self.intents)])
            positive = intent == gold
            negated = rng.random() < 0.3
            template = rng.choice(NEGATED_INTENT if negated else NOUL_TEMPLATES)
            qid = question_id(rng, intent, used)
            questions[qid] = _noul(template.format(intent=intent_description(intent)), rng)
            labels[qid] = positive != negated
        return Example(f"b77-{n}", {"model": "clef-demo", "state": text, "questions": questions}, labels)

    def full_choice(self, n: int) -> Example:
        """The evaluation's 77-way question (its instruction or another wording), alone in the record."""
        rng = self.rng
        text, gold = rng.choice(self.b77)
        question: dict[str, Any] = {"type": "choice", "criteria": {i: None for i in self.intents}}
        wording = rng.choice([BANKING77_INSTRUCTIONS, BANKING77_INSTRUCTIONS, *CHOICE_INSTRUCTIONS[1:-1]])
        question["instructions"] = wording
        qid = question_id(rng, "intent", set())
        return Example(f"b77-full-{n}", {"model": "clef-demo", "state": text, "questions": {qid: question}},
                       {qid: gold})

    def nlupp(self, n: int) -> Example:
        rng = self.rng
        text, gold = rng.choice(self.nlu)
        names = list(self.nlu_intents)
        positives = [i for i in names if i in gold]
        negatives = [i for i in names if i not in gold]
        count = rng.randint(1, 3)
        picked = rng.sample(positives, min(len(positives), rng.randint(0, count))) if positives else []
        picked += rng.sample(negatives, count - len(picked))
        used: set[str] = set()
        questions: dict[str, Any] = {}
        labels: dict[str, Any] = {}
        for intent in picked:
            qid = question_id(rng, intent, used)
            description = self.nlu_intents[intent]
            negated = rng.random() < 0.25 and description.startswith("is the intent ")
            if negated:
                description = "is the intent not " + description.removeprefix("is the intent ")
            questions[qid] = _noul(description, rng)
            labels[qid] = (intent in gold) != negated
        if rng.random() < 0.25:
            listed = rng.sample(names, 3)
            if positives and rng.random() < 0.5:
                listed[0] = rng.choice(positives)
            rng.shuffle(listed)
            qid = question_id(rng, "how_many", used)
            questions[qid] = _score("How many of these intents does the message carry: "
                                    + "; ".join(intent_description(i) for i in listed) + "?", COUNT_LEVELS)
            labels[qid] = sum(i in gold for i in listed)
        keys = list(questions)
        rng.shuffle(keys)
        return Example(f"nlupp-{n}", {"model": "clef-demo", "state": text,
                                      "questions": {k: questions[k] for k in keys}}, {k: labels[k] for k in keys})

    def sentiment(self, n: int) -> Example:
        rng = self.rng
        word, rating = rng.choice(self.words)
        template = rng.choice(VADER_TEMPLATES)
        state = template.format(word=word, text=rng.choice(self.b77)[0]).strip()
        used: set[str] = set()
        questions: dict[str, Any] = {}
        labels: dict[str, Any] = {}
        for kind in rng.sample(["polarity", "strength", "positive", "choice"], rng.randint(1, 2)):
            if kind == "polarity":
                qid = question_id(rng, "sentiment", used)
                questions[qid] = _score(rng.choice(POLARITY_QUESTIONS), rng.choice(POLARITY_LEVELS))
                labels[qid] = 0 if rating <= -2.5 else 1 if rating < -0.5 else 3 if rating < 2.5 else 4
            elif kind == "strength":
                qid = question_id(rng, "intensity", used)
                questions[qid] = _score(rng.choice(STRENGTH_QUESTIONS), rng.choice(STRENGTH_LEVELS))
                labels[qid] = 0 if abs(rating) < 1.5 else 1 if abs(rating) < 2.5 else 2
            elif kind == "positive":
                asks_positive = rng.random() < 0.5
                negated = rng.random() < 0.25
                wordings = (NOT_POSITIVE if negated else POSITIVE_QUESTIONS) if asks_positive else \
                    (NOT_NEGATIVE if negated else NEGATIVE_QUESTIONS)
                qid = question_id(rng, "positive" if asks_positive else "negative", used)
                questions[qid] = _noul(rng.choice(wordings), rng)
                labels[qid] = ((rating > 0) == asks_positive) != negated
            else:
                qid = question_id(rng, "tone", used)
                describe = rng.random() < 0.5
                questions[qid] = {"type": "choice", "criteria": {
                    "positive": "The writer is pleased" if describe else None,
                    "negative": "The writer is displeased" if describe else None}}
                if rng.random() < 0.7:
                    questions[qid]["instructions"] = "Is the tone of the message positive or negative?"
                labels[qid] = "positive" if rating > 0 else "negative"
        return Example(f"sentiment-{n}", {"model": "clef-demo", "state": state, "questions": questions}, labels)

    def severity(self, n: int) -> Example:
        rng = self.rng
        ladder: Ladder = rng.choice(self.ladders)
        rank = rng.randrange(len(ladder.levels))
        state = rng.choice(OPENERS) + ladder.levels[rank]
        top = len(ladder.levels) - 1
        used: set[str] = set()
        questions: dict[str, Any] = {}
        labels: dict[str, Any] = {}
        for kind in rng.sample(["severity", "urgency", "emergency", "route"], rng.randint(1, 2)):
            if kind in ("severity", "urgency"):
                count = rng.choice([3, 3, 4, 5, 5, 10])
                levels = rng.choice(SEVERITY_LEVELS[count])
                wording = rng.choice(SEVERITY_QUESTIONS if kind == "severity" else URGENCY_QUESTIONS)
                qid = question_id(rng, kind, used)
                questions[qid] = _score(wording, levels)
                labels[qid] = _level(rank, top, count)
            elif kind == "emergency":
                if rank == top - 1:
                    continue  # serious but not plainly an emergency: no clean label
                qid = question_id(rng, "emergency", used)
                questions[qid] = _noul(rng.choice(EMERGENCY_QUESTIONS), rng)
                labels[qid] = rank == top
            else:
                names = list(self.domains)
                options = [ladder.domain, *rng.sample([d for d in names if d != ladder.domain], rng.randint(1, 5))]
                rng.shuffle(options)
                describe = rng.random() < 0.7
                qid = question_id(rng, "team", used)
                questions[qid] = {"type": "choice", "criteria": {
                    d: self.domains[d] if describe else None for d in options}}
                if (routing := rng.choice(ROUTING_QUESTIONS)) is not None:
                    questions[qid]["instructions"] = routing
                labels[qid] = ladder.domain
        if not questions:
            return self.severity(n)
        return Example(f"severity-{n}", {"model": "clef-demo", "state": state, "questions": questions}, labels)


def decision_data(records: int, mix: DecisionMix = DecisionMix(), seed: int = 0) -> tuple[list[Example], list[Twin]]:
    """``records`` labelled records drawn by ``mix``, and twins of a ``mix.twins`` share of them (each twin's
    first record is the original with unrelated unlabelled questions added, so twins also tie questions no data
    labels). The 77-way records are twinned only by renaming: their 1,600 option tokens before a reordered
    question would cost what twenty other records cost."""
    gen = Generator(seed)
    kinds = ["banking77", "full_choice", "nlupp", "sentiment", "severity"]
    weights = [getattr(mix, k) for k in kinds]
    examples: list[Example] = []
    twins: list[Twin] = []
    twin_rng = random.Random(seed + 7)
    for n in range(records):
        kind = gen.rng.choices(kinds, weights)[0]
        example = getattr(gen, kind)(n)
        if twin_rng.random() < mix.twins:
            if kind == "full_choice":
                (qid, question), = example.request["questions"].items()
                new = question_id(twin_rng, "renamed", {qid})
                twins.append(Twin(example, Example(example.id + "-renamed", {
                    **example.request, "questions": {new: question}}, {new: example.labels[qid]}), {qid: new}))
            else:
                twins.append(make_twin(twin_rng, n, example))
        else:
            examples.append(example)
    return examples, twins
