"""Spliced head-training records: the premise (a state's hidden states do not see the schema), relabelling, joins."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training import hidden_cache
from clef_local.training.common import encode_examples, gold_index
from clef_local.training.demo_data import Rule, splice_states, training_examples, twin_records
from clef_local.training.hidden_cache import cache_hidden_states
from clef_local.training.splicing import EpochHidden, Splicer, cache_state_bank, state_records
from clef_local.training.train_head import TrainConfig, train


@pytest.fixture
def float32_cache(monkeypatch):
    """Exact comparisons: the cache computes in float32 whatever this CPU's fast path is."""
    monkeypatch.setattr(hidden_cache, "cache_dtype", lambda device: torch.float32)


def test_rules_relabel_a_question_for_another_state():
    assert Rule("intent", ("card_arrival", "top_up_failed")).label("top_up_failed") == "top_up_failed"
    assert Rule("intent", ("card_arrival", "top_up_failed")).label("lost_or_stolen_card") is None  # not an option
    assert Rule("is", ("card_arrival",)).label("card_arrival") is True
    assert Rule("is", ("card_arrival",)).label("top_up_failed") is False
    assert Rule("has", ("refund",)).label(frozenset({"refund", "card"})) is True
    assert Rule("count", ("a", "b", "c")).label(frozenset({"a", "c", "z"})) == 2
    states = splice_states()
    for example in training_examples(banking77=30, nlupp=30, seed=5):
        # every labelled question has a rule, and the rule gives back the example's own label from its own gold
        assert set(example.rules) == set(example.labels)
        row = next(r for r in states[example.source] if r[0] == example.request["state"])
        assert example.relabel(row[1]) == example.labels


def test_state_hidden_states_are_those_of_the_whole_request(tiny_llama: Path, tmp_path: Path, float32_cache):
    tokenizer = ReleaseTokenizer(tiny_llama)
    examples = training_examples(banking77=4, nlupp=2, seed=1)
    records = [e for e, _ in encode_examples(tokenizer, examples, 4096)]
    full = cache_hidden_states(tiny_llama, records, tmp_path / "cache")
    states = state_records(tokenizer, [e.request["state"] for e in examples])
    alone = cache_hidden_states(tiny_llama, states, tmp_path / "cache")
    for record, state, h_full, h_state in zip(records, states, full, alone, strict=True):
        end = record.state_start + record.state_tokens
        assert state.input_ids == record.input_ids[:end]
        # causal attention: the state's tokens never see the schema after them
        torch.testing.assert_close(h_state.float(), h_full[:end].float(), atol=1e-4, rtol=0)


def test_spliced_records_join_a_state_to_a_donor_schema(tiny_llama: Path, tmp_path: Path, float32_cache):
    tokenizer = ReleaseTokenizer(tiny_llama)
    examples = training_examples(banking77=6, nlupp=4, seed=2, full_share=0.0)
    pairs = encode_examples(tokenizer, examples, 4096)
    encoded = [e for e, _ in pairs]
    hidden = cache_hidden_states(tiny_llama, encoded, tmp_path / "cache")
    states = {source: rows[:40] for source, rows in splice_states().items()}
    bank = cache_state_bank(tiny_llama, tokenizer, states, tmp_path / "cache", "cpu")
    splicer = Splicer(tokenizer, 4096, list(enumerate(examples)), encoded, hidden, states, bank, gold_index)
    spliced = splicer.draw(24, random.Random(0))
    epoch = EpochHidden(hidden, splicer, spliced)
    for k, (record, (state, donor), gold) in enumerate(zip(spliced.encoded, spliced.parts, spliced.gold,
                                                           strict=True)):
        example = examples[donor]
        source_offset = 0 if example.source == "banking77" else len(states["banking77"])
        text, row_gold = states[example.source][state - source_offset]
        assert record.input_ids[record.state_start : record.state_start + record.state_tokens] == tuple(
            tokenizer.encode_pieces([text])[0])
        expected = example.relabel(row_gold)
        assert gold == [gold_index(q.question_type, q.option_ids, expected.get(q.question_id))
                        for q in record.questions]
        joined = epoch[len(encoded) + k]
        cut = record.state_start + record.state_tokens
        donor_cut = encoded[donor].state_start + encoded[donor].state_tokens
        assert joined.shape[0] == len(record.input_ids)
        assert torch.equal(joined[:cut], bank[example.source][state - source_offset])
        assert torch.equal(joined[cut:], hidden[donor][donor_cut:])
    assert any(g == -1 for gold in spliced.gold for g in gold)  # a choice without the row's intent: no label
    assert {examples[d].source for _, d in spliced.parts} == {"banking77", "nlupp"}


def test_training_with_spliced_records_keeps_validation_states_out(tiny_llama: Path, tmp_path: Path,
                                                                  float32_cache, monkeypatch):
    from clef_local.training import train_head

    examples = training_examples(banking77=20, nlupp=10, seed=3)
    texts = {e.request["state"] for e in examples}
    states = {source: [row for row in rows if row[0] in texts] + rows[:60] for source, rows in splice_states().items()}
    seen: dict[str, list] = {}
    real = train_head.Splicer

    def spy(*args):
        splicer = real(*args)
        seen.update(splicer.states)
        return splicer

    monkeypatch.setattr(train_head, "Splicer", spy)
    config = TrainConfig(width=32, heads=4, feedforward=64, epochs=2, batch_records=8, spliced=12)
    log = train(tiny_llama, examples, tmp_path / "head", work=tmp_path / "work", config=config, states=states,
                validation=0.2)
    assert [h["epoch"] for h in log["history"]] == [1, 2]
    val_states = {examples[i].request["state"] for i in range(len(examples))} - {
        text for rows in seen.values() for text, _ in rows}
    assert len(val_states) == log["validation"]  # exactly the validation records' states were left out


def test_spliced_records_train_beside_twins(tiny_llama: Path, tmp_path: Path, float32_cache):
    # Spliced records sit after the exact ones and twins in an epoch's index space; the twin term must look them
    # up there (it once indexed the exact records only and failed on the first mixed batch).
    examples = training_examples(banking77=12, nlupp=6, seed=5)
    states = {source: rows[:40] for source, rows in splice_states().items()}
    config = TrainConfig(width=32, heads=4, feedforward=64, epochs=1, batch_records=16, spliced=24)
    log = train(tiny_llama, examples, tmp_path / "head", work=tmp_path / "work", config=config, states=states,
                twins=twin_records(16, seed=2), validation=0.3)
    last = log["history"][-1]
    assert log["twins"] == 16 and 0.0 <= last["val_twin_mean_dp"] <= last["val_twin_max_dp"] <= 1.0
