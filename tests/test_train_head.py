"""Head training on a tiny backbone: loss math, outputs that load as a release head, resumable stages."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import clef_local
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import encode_examples
from clef_local.training.demo_data import intent_neighbours, training_examples, twin_records
from clef_local.training.head_losses import StateAttention, question_loss, state_mask, twin_loss
from clef_local.training.hidden_cache import block_name, cache_dtype, cache_hidden_states
from clef_local.training.train_head import TrainConfig, record_batch, train, twin_rows

SMALL = TrainConfig(width=32, heads=4, feedforward=64, epochs=2, batch_records=8)


def test_question_loss_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")]])
    # p = [0.25, 0.75]; gold 1: CE = 0.95·(−ln .75) + 0.05·(−ln .25 − ln .75)/2; Brier = .25² + .25²
    expected = 0.95 * -math.log(0.75) + 0.05 * (-math.log(0.25) - math.log(0.75)) / 2 + 2 * 0.0625
    assert float(question_loss(logits, torch.tensor([1]), 0.05, 1.0)) == pytest.approx(expected, rel=1e-6)


def test_train_writes_a_loadable_head_and_resumes(tiny_llama: Path, tmp_path: Path):
    examples = training_examples(banking77=24, nlupp=16, seed=3)
    out, work = tmp_path / "head", tmp_path / "work"
    result = train(tiny_llama, examples, out, work=work, config=SMALL)
    assert [h["epoch"] for h in result["history"]] == [1, 2]
    assert json.loads((out / "joint_head_config.json").read_text()) == {
        "hidden_size": 64, "width": 32, "routing_layers": 1, "layers": 2, "heads": 4, "feedforward": 64}
    chunks = {p: p.stat().st_mtime_ns for p in (work / "hidden").rglob("chunk-*.safetensors")}
    assert chunks
    # A second run finds the cache and the final checkpoint: nothing is recomputed, the head is the same.
    before = (out / "joint_head.safetensors").read_bytes()
    train(tiny_llama, examples, out, work=work, config=SMALL)
    assert {p: p.stat().st_mtime_ns for p in chunks} == chunks
    assert (out / "joint_head.safetensors").read_bytes() == before
    release = tmp_path / "release"
    shutil.copytree(tiny_llama, release)
    for name in ("joint_head.safetensors", "joint_head_config.json"):
        shutil.copyfile(out / name, release / name)
    answer = clef_local.load(release).decide(examples[0].request)
    assert set(answer["answers"]) == set(examples[0].request["questions"])


def test_demo_data_grows_by_prefix():
    small, large = training_examples(banking77=10, nlupp=6, seed=1), training_examples(banking77=14, nlupp=9, seed=1)
    assert [e.request for e in small[:10]] == [e.request for e in large[:10]]
    assert [e.request for e in small[10:]] == [e.request for e in large[14:20]]
    assert all(set(e.labels) == set(e.request["questions"]) for e in large)


def test_intent_neighbours_are_the_closest_word_profiles():
    rows = [("my card has not arrived", "card_arrival"), ("when will my card arrive", "card_arrival"),
            ("card delivery time estimate", "card_delivery_estimate"), ("how long until my card is delivered",
                                                                        "card_delivery_estimate"),
            ("what is the exchange rate", "exchange_rate"), ("exchange rate for euros", "exchange_rate"),
            ("I was charged an exchange fee", "exchange_charge")]
    near = intent_neighbours(rows, k=2)
    assert near["card_arrival"][0] == "card_delivery_estimate"
    assert near["exchange_rate"][0] == "exchange_charge"
    assert all(intent not in others for intent, others in near.items())


def test_hard_negative_choices_hold_the_gold_and_its_neighbours():
    from clef_local.data.datasets import banking77_rows

    near = intent_neighbours(banking77_rows("train"))
    plain = training_examples(banking77=40, nlupp=0, seed=3)
    assert [e.request for e in plain] == [e.request for e in training_examples(40, 0, seed=3, hard=0.0)]
    hard = training_examples(banking77=40, nlupp=0, seed=3, hard=1.0, max_options=8)
    shares = []
    for example in hard:
        for qid, question in example.request["questions"].items():
            if question["type"] == "choice":
                options = set(question["criteria"])
                gold = example.labels[qid]
                assert gold in options and 2 <= len(options) <= 8
                shares.append(len(options & set(near[gold])) / (len(options) - 1))
    assert len(shares) == 40 and min(shares) == 1.0  # every distractor is one of the gold's neighbours


def test_cache_blocks_are_reused_and_a_bad_chunk_is_named(tiny_llama: Path, tmp_path: Path):
    tokenizer = ReleaseTokenizer(tiny_llama)
    encoded = [e for e, _ in encode_examples(tokenizer, training_examples(banking77=6, nlupp=0, seed=2), 4096)]
    cache = tmp_path / "hidden"
    first = cache_hidden_states(tiny_llama, encoded[:4], cache, block_records=2)
    stamps = {p: p.stat().st_mtime_ns for p in cache.rglob("chunk-*")}
    grown = cache_hidden_states(tiny_llama, encoded, cache, block_records=2)
    assert len(list(cache.glob("block-*"))) == 3
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # the first two blocks were not recomputed
    assert all(torch.equal(a, b) for a, b in zip(first, grown[:4], strict=False))
    assert [h.shape[0] for h in grown] == [len(e.input_ids) for e in encoded]
    bad = sorted(cache.rglob("chunk-*"))[0]
    bad.write_bytes(bad.read_bytes()[:20])
    with pytest.raises(RuntimeError, match=bad.name):
        cache_hidden_states(tiny_llama, encoded, cache, block_records=2)


def test_cache_computes_in_bf16_where_it_is_fast_and_names_blocks_by_dtype(tiny_llama: Path, monkeypatch):
    from clef_local.planning import hardware

    assert cache_dtype("cuda") == torch.bfloat16
    for fast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        cpu = hardware.detect_cpu()
        monkeypatch.setattr(hardware, "detect_cpu",
                            lambda *_, cpu=cpu, fast=fast, **__: replace(cpu, fast_bf16=fast))
        assert cache_dtype("cpu") == expected
    tokenizer = ReleaseTokenizer(tiny_llama)
    block = [e for e, _ in encode_examples(tokenizer, training_examples(banking77=2, nlupp=0, seed=2), 4096)]
    # float32 keeps the names older caches were written under; BF16 states are never mistaken for them
    assert block_name(block) == block_name(block, torch.float32) != block_name(block, torch.bfloat16)


def test_state_attention_is_the_modules_own_attention_mass_on_the_state(tiny_llama: Path):
    tokenizer = ReleaseTokenizer(tiny_llama)
    pairs = encode_examples(tokenizer, training_examples(banking77=3, nlupp=1, seed=4), 4096)
    encoded, gold = [e for e, _ in pairs], [g for _, g in pairs]
    for record, example in zip(encoded, training_examples(banking77=3, nlupp=1, seed=4), strict=True):
        state = tokenizer.encode_pieces([example.request["state"]])[0]
        assert list(record.input_ids[record.state_start : record.state_start + record.state_tokens]) == state
    torch.manual_seed(0)
    hidden = [torch.randn(len(e.input_ids), 64) for e in encoded]
    embedding = torch.randn(tokenizer.vocab_size, 64)
    head = JointSchemaHead(HeadConfig(
        hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64)).train()
    states, mask, lexical, layout, _ = record_batch(list(range(4)), encoded, hidden, gold, embedding)
    masses = []  # what each cross-attention module itself computes, averaged over heads, per query

    def own_weights(module, args, kwargs, output):
        if kwargs.get("need_weights"):
            return  # the call below, re-entering the hooks
        _, weights = module(args[0], args[1], args[2], key_padding_mask=kwargs.get("key_padding_mask"),
                            need_weights=True, average_attn_weights=True)
        masses.append(weights)

    modules = [head.evidence_layers[0].attention, head.layers[0].multihead_attn, head.layers[1].multihead_attn]
    evidence = StateAttention(head)
    handles = [m.register_forward_hook(own_weights, with_kwargs=True) for m in modules]
    evidence.state_mask = state_mask(encoded, states.shape[1])
    head(states, mask, lexical, layout)
    for handle in handles:
        handle.remove()
    evidence.terms = evidence.terms[0::2]  # the first of each pair: the head's own call (then the re-entry)
    expected = torch.stack([-torch.log((w * evidence.state_mask[:, None, :]).sum(-1)).mean() for w in masses]).mean()
    assert float(evidence.loss().detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    evidence.state_mask = mask.bool()  # every real token counts as state: all mass is there, the term is 0
    head(states, mask, lexical, layout)
    assert float(evidence.loss().detach()) == pytest.approx(0.0, abs=1e-5)
    evidence.remove()
    head(states, mask, lexical, layout)
    assert evidence.terms == []


def test_unlabelled_questions_are_left_out_of_the_loss():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")], [5.0, 0.0, 1.0]])
    alone = question_loss(logits[:1], torch.tensor([1]), 0.05, 1.0)
    assert float(question_loss(logits, torch.tensor([1, -1]), 0.05, 1.0)) == pytest.approx(float(alone))
    assert float(question_loss(logits, torch.tensor([-1, -1]), 0.05, 1.0)) == 0.0


def test_a_question_weight_counts_it_that_many_times():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")], [5.0, 0.0, 1.0], [0.5, 0.0, -1.0]])
    gold = torch.tensor([1, 2, -1])
    weighted = question_loss(logits, gold, 0.05, 1.0, torch.tensor([3.0, 1.0, 7.0]))  # the unlabelled 7 drops out
    repeated = question_loss(logits[[0, 0, 0, 1]], gold[[0, 0, 0, 1]], 0.05, 1.0)
    assert float(weighted) == pytest.approx(float(repeated), rel=1e-6)
    assert float(weighted) != pytest.approx(float(question_loss(logits, gold, 0.05, 1.0)), rel=1e-3)


def test_twin_loss_is_symmetric_kl():
    p, q = torch.tensor([0.25, 0.75]), torch.tensor([0.5, 0.5])
    logits = torch.stack([torch.cat([p.log(), torch.tensor([float("-inf")])]),
                          torch.cat([q.log(), torch.tensor([float("-inf")])])])
    kl = float((p * (p / q).log()).sum() + (q * (q / p).log()).sum()) / 2
    assert float(twin_loss(logits, [(0, 1)])) == pytest.approx(kl, rel=1e-6)
    assert float(twin_loss(logits, [(0, 0)])) == 0.0


def test_twins_map_questions_across_renames_and_reorders(tiny_llama: Path):
    tokenizer = ReleaseTokenizer(tiny_llama)
    for twin in twin_records(12, seed=5):
        assert set(twin.same) <= set(twin.first.request["questions"])
        assert set(twin.same.values()) <= set(twin.second.request["questions"])
        for a, b in twin.same.items():  # the same question, maybe renamed, with the same label
            assert twin.first.request["questions"][a] == twin.second.request["questions"][b]
            assert twin.first.labels.get(a) == twin.second.labels.get(b)
        pairs = encode_examples(tokenizer, [twin.first, twin.second], 4096)
        encoded = [e for e, _ in pairs]
        rows = twin_rows([0, 1], encoded, {0: (1, twin.same)})
        assert len(rows) == len(twin.same)
        first_q, second_q = encoded[0].questions, encoded[1].questions
        n_first = len(first_q)
        for a, b in rows:
            assert twin.same[first_q[a].question_id] == second_q[b - n_first].question_id


def test_train_with_twins_reports_their_consistency(tiny_llama: Path, tmp_path: Path):
    examples = training_examples(banking77=8, nlupp=4, seed=3)
    result = train(tiny_llama, examples, tmp_path / "head", work=tmp_path / "work", config=SMALL,
                   twins=twin_records(40, seed=1), validation=0.3)
    last = result["history"][-1]
    assert result["twins"] == 40
    assert 0.0 <= last["val_twin_mean_dp"] <= last["val_twin_max_dp"] <= 1.0


def test_init_fine_tunes_an_existing_head(tiny_llama: Path, tmp_path: Path):
    from safetensors.torch import load_file

    from clef_local.errors import ReleaseError

    examples = training_examples(banking77=12, nlupp=4, seed=3)
    first = tmp_path / "first"
    train(tiny_llama, examples, first, work=tmp_path / "w1", config=SMALL)
    # a different width in the config is overridden by the head being fine-tuned; lr 0 keeps its weights exactly
    still = TrainConfig(width=48, heads=4, feedforward=64, epochs=1, batch_records=8, lr=0.0)
    result = train(tiny_llama, examples, tmp_path / "tuned", work=tmp_path / "w2", config=still, init=first)
    assert result["init"] == str(first)
    want, got = (load_file(str(d / "joint_head.safetensors")) for d in (first, tmp_path / "tuned"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert (tmp_path / "tuned" / "joint_head_config.json").read_text() == (first / "joint_head_config.json").read_text()
    config = json.loads((first / "joint_head_config.json").read_text())
    (first / "joint_head_config.json").write_text(json.dumps({**config, "hidden_size": 99}))
    with pytest.raises(ReleaseError, match="hidden size 99"):
        train(tiny_llama, examples, tmp_path / "bad", work=tmp_path / "w3", config=still, init=first)


def test_weight_decay_shrinks_matrices_only():
    from clef_local.training.common import parameter_groups

    head = JointSchemaHead(HeadConfig(hidden_size=16, width=16, routing_layers=1, layers=1, heads=2, feedforward=32))
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(1.0)
    optimizer = torch.optim.AdamW(parameter_groups(head, 0.1), lr=0.5)
    for p in head.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients: only decoupled weight decay moves a parameter, by lr·wd
    for name, p in head.named_parameters():
        want = 1.0 - 0.5 * 0.1 if p.ndim >= 2 else 1.0
        assert torch.allclose(p, torch.full_like(p, want)), name
    assert head.joint_logit_scale.ndim < 2


def test_a_fresh_head_starts_at_the_configured_cosine_temperature(tiny_llama: Path, tmp_path: Path):
    from safetensors.torch import load_file

    examples = training_examples(banking77=8, nlupp=4, seed=1)
    still = replace(SMALL, epochs=1, lr=0.0, joint_scale_init=2.3)  # lr 0: the saved head is the initial one
    train(tiny_llama, examples, tmp_path / "head", work=tmp_path / "work", config=still)
    saved = load_file(str(tmp_path / "head" / "joint_head.safetensors"))
    assert float(saved["joint_logit_scale"]) == pytest.approx(2.3)


@pytest.mark.parametrize("argv, message", [
    (["--hard-negatives", "50"], "--hard-negatives is a share between 0 and 1, got 50"),
    (["--full-choice", "1.5"], "--full-choice is a share between 0 and 1, got 1.5"),
    (["--data", "requests.jsonl", "--spliced", "8"], "--spliced needs the demo data"),
    (["--data", "requests.jsonl", "--spliced", "8", "--cache-only"], "--spliced needs the demo data"),
])
def test_train_head_refuses_options_it_cannot_honour(tmp_path: Path, capsys, argv: list[str], message: str):
    from clef_local.training.train_head import main

    (tmp_path / "requests.jsonl").write_text(json.dumps({"request": {"state": "x", "questions": {}}, "labels": {}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--backbone", str(tmp_path), "--out", str(tmp_path / "out"),
              *[str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv]])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_autocast_is_bf16_on_accelerators_and_never_for_span_means_or_gradients(tiny_llama: Path):
    from clef_local.heads.torch_head import _span_mean
    from clef_local.training.train_head import autocast_dtype

    assert autocast_dtype("off", "cuda") is None and autocast_dtype("bf16", "cpu") == torch.bfloat16
    assert autocast_dtype("auto", "cuda:1") == autocast_dtype("auto", "mps") == torch.bfloat16
    assert autocast_dtype("auto", "cpu") is None  # even with AMX: opt in with "bf16"
    with pytest.raises(ValueError, match="autocast must be one of"):
        autocast_dtype("fp16", "cpu")

    tokenizer = ReleaseTokenizer(tiny_llama)
    pairs = encode_examples(tokenizer, training_examples(banking77=4, nlupp=2, seed=5), 4096)
    encoded, gold = [e for e, _ in pairs], [g for _, g in pairs]
    torch.manual_seed(1)
    hidden = [torch.randn(len(e.input_ids), 64) for e in encoded]
    states, mask, lexical, layout, target = record_batch(list(range(6)), encoded, hidden, gold,
                                                   torch.randn(tokenizer.vocab_size, 64))
    values = torch.randn(50, 8)
    index, offsets = torch.tensor([0, 3, 7, 9, 49]), torch.tensor([0, 2, 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        means = _span_mean(values, index, offsets)
    assert means.dtype == torch.float32 and torch.equal(means, _span_mean(values, index, offsets))
    head = JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4,
                                      feedforward=64)).eval()
    with torch.no_grad():
        reference = torch.softmax(head(states, mask, lexical, layout), -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(states, mask, lexical, layout).float()
    assert float((torch.softmax(logits.detach(), -1) - reference).abs().max()) < 0.02
    question_loss(logits, target, 0.05, 1.0).backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in head.parameters())


def test_training_under_bf16_autocast_tracks_float32(tiny_llama: Path, tmp_path: Path):
    examples = training_examples(banking77=24, nlupp=16, seed=3)
    losses = {}
    for setting in ("off", "bf16"):
        result = train(tiny_llama, examples, tmp_path / setting, work=tmp_path / f"work-{setting}",
                       config=replace(SMALL, autocast=setting), cache=tmp_path / "hidden")
        assert result["config"]["autocast"] == setting
        losses[setting] = [h["train_loss"] for h in result["history"]]
    assert losses["bf16"][-1] < losses["bf16"][0]
    assert losses["bf16"] == pytest.approx(losses["off"], rel=0.05)
