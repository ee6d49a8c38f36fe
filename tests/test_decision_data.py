"""The synthetic decision data of adapter training (clef_local.training.decision_data) and its sources
(clef_local.data.sources): every label follows from data, held-out material stays out, twins pair the same
questions."""

from __future__ import annotations

import collections

from clef_local.data.datasets import banking77_rows, intent_description, nlupp_rows
from clef_local.data.sources import severity_domains, severity_ladders, vader_words
from clef_local.training.decision_data import NEGATED_INTENT, DecisionMix, decision_data


def test_vader_words_are_the_lexicons_agreed_ratings() -> None:
    words = dict(vader_words())
    assert (words["excellent"], words["good"], words["horrible"], words["terrible"]) == (2.7, 1.9, -2.5, -2.1)
    assert "okay" in words and ":)" not in words  # plain words only, |mean| >= 0.5
    assert all(abs(v) >= 0.5 for v in words.values()) and 4000 < len(words) < 5000


def test_severity_ladders_rise_in_four_steps_and_keep_a_held_out_split() -> None:
    train, heldout = severity_ladders("train"), severity_ladders("heldout")
    assert (len(train), len(heldout)) == (16, 8)
    assert all(len(ladder.levels) == 4 for ladder in train + heldout)
    assert {ladder.domain for ladder in heldout} <= set(severity_domains())
    assert not {t for lad in train for t in lad.levels} & {t for lad in heldout for t in lad.levels}


def _check_label(question: dict, label: object) -> None:
    if question["type"] == "noul":
        assert isinstance(label, bool)
    elif question["type"] == "choice":
        assert label in question["criteria"]
    else:
        assert isinstance(label, int) and 0 <= label < len(question["criteria"])


def test_records_are_labelled_from_data_and_the_same_for_the_same_seed() -> None:
    examples, twins = decision_data(400)
    again, _ = decision_data(400)
    assert [e.request for e in examples] == [e.request for e in again]
    kinds = collections.Counter(e.id.split("-")[0] for e in examples)
    assert set(kinds) == {"b77", "nlupp", "sentiment", "severity"} and min(kinds.values()) > 30
    assert 0.25 < len(twins) / 400 < 0.45
    heldout = {text for ladder in severity_ladders("heldout") for text in ladder.levels}
    train_texts = {t for t, _ in banking77_rows("train")} | {t for t, _ in nlupp_rows(range(16))}
    for example in examples:
        assert example.labels and set(example.labels) <= set(example.request["questions"])
        for qid, label in example.labels.items():
            _check_label(example.request["questions"][qid], label)
        state = example.request["state"]
        assert not any(text in state for text in heldout)
        if example.id.startswith(("b77", "nlupp")):
            assert state in train_texts  # never a test row


def test_negated_intent_questions_flip_the_label() -> None:
    gold = dict(banking77_rows("train"))
    negated = 0
    for example in decision_data(1500)[0]:
        if not example.id.startswith("b77-"):
            continue
        intent_of = {intent_description(i): i for i in set(gold.values())}
        for qid, question in example.request["questions"].items():
            text = question.get("instructions", "")
            for template in NEGATED_INTENT:
                head, tail = template.split("{intent}")
                if question["type"] == "noul" and text.startswith(head) and text.endswith(tail):
                    intent = intent_of[text[len(head):len(text) - len(tail)]]
                    assert example.labels[qid] == (intent != gold[example.request["state"]])
                    negated += 1
    assert negated > 10


def test_twins_pair_the_same_questions_of_the_same_state() -> None:
    _, twins = decision_data(300, DecisionMix(twins=1.0))
    assert len(twins) == 300
    for twin in twins:
        assert twin.first.request["state"] == twin.second.request["state"]
        for first_id, second_id in twin.same.items():
            assert twin.first.request["questions"][first_id] == twin.second.request["questions"][second_id]
            if first_id in twin.first.labels:
                assert twin.second.labels[second_id] == twin.first.labels[first_id]
