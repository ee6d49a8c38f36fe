"""What head training is made of: the losses by hand, the demo data, the caches, the question table, the
calibration fold, and the ``train-head`` command line (its defaults are the shipped head's recipe; a flag it
cannot honour is one line and exit status 2)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from clef_local.data.datasets import banking77_intents, banking77_request
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.encoding import encode_request
from clef_local.runtime.layout import build_layout
from clef_local.runtime.schema import validate_request
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.config import TrainConfig
from clef_local.training.demo_data import intent_neighbours, training_examples, twin_records
from clef_local.training.head_losses import logit_temperature, question_loss, twin_loss
from clef_local.training.hidden_cache import block_name, cache_dtype, cache_hidden_states, question_means
from clef_local.training.loop import parameter_groups
from clef_local.training.questions import build_questions
from clef_local.training.records import LexicalTable, encode_examples, twin_rows
from clef_local.training.train_head import main
from clef_local.training.validation import apply_temperature


def test_question_loss_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")]])
    # p = [0.25, 0.75]; gold 1: CE = 0.95·(−ln .75) + 0.05·(−ln .25 − ln .75)/2; Brier = .25² + .25²
    expected = 0.95 * -math.log(0.75) + 0.05 * (-math.log(0.25) - math.log(0.75)) / 2 + 2 * 0.0625
    assert float(question_loss(logits, torch.tensor([1]), 0.05, 1.0)) == pytest.approx(expected, rel=1e-6)


def test_unlabelled_questions_are_left_out_of_the_loss():
    logits = torch.tensor([[0.0, math.log(3.0), float("-inf")], [5.0, 0.0, 1.0]])
    alone = question_loss(logits[:1], torch.tensor([1]), 0.05, 1.0)
    assert float(question_loss(logits, torch.tensor([1, -1]), 0.05, 1.0)) == pytest.approx(float(alone))
    assert float(question_loss(logits, torch.tensor([-1, -1]), 0.05, 1.0)) == 0.0


def test_twin_loss_is_symmetric_kl():
    p, q = torch.tensor([0.25, 0.75]), torch.tensor([0.5, 0.5])
    logits = torch.stack([torch.cat([p.log(), torch.tensor([float("-inf")])]),
                          torch.cat([q.log(), torch.tensor([float("-inf")])])])
    kl = float((p * (p / q).log()).sum() + (q * (q / p).log()).sum()) / 2
    assert float(twin_loss(logits, [(0, 1)])) == pytest.approx(kl, rel=1e-6)
    assert float(twin_loss(logits, [(0, 0)])) == 0.0


def test_weight_decay_shrinks_matrices_only_and_frozen_parameters_stay_out():
    head = JointSchemaHead(HeadConfig(hidden_size=16, width=16, routing_layers=1, layers=1, heads=2, feedforward=32))
    head.global_projection.weight.requires_grad_(False)
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(1.0)
    groups = parameter_groups(head, 0.1)
    assert all(p is not head.global_projection.weight for g in groups for p in g["params"])
    optimizer = torch.optim.AdamW(groups, lr=0.5)
    for p in head.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients: only decoupled weight decay moves a parameter, by lr·wd
    for name, p in head.named_parameters():
        want = 1.0 - 0.5 * 0.1 if p.ndim >= 2 and p.requires_grad else 1.0
        assert torch.allclose(p, torch.full_like(p, want)), name


def test_a_fitted_temperature_is_recovered_and_folded_into_the_heads_weights(tiny_llama: Path):
    """Labels drawn at temperature 2.5 from a random head's answers give back ~2.5; folded into the weights (the
    prior's and cosine's log scales, the residual scorer's output) it multiplies every logit, the prior's too."""
    tokenizer = ReleaseTokenizer(tiny_llama)
    encoded = [e for e, _ in encode_examples(tokenizer, training_examples(banking77=6, nlupp=4, seed=2), 4096)]
    torch.manual_seed(1)
    head = JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=1, heads=2,
                                      feedforward=32)).eval()
    with torch.no_grad():
        head.prior_logit_scale.fill_(1.0)  # live: the fold must scale it too
    length = max(len(e.input_ids) for e in encoded)
    layout = build_layout(encoded, length).map(torch.from_numpy)
    hidden, mask = torch.randn(len(encoded), length, 64), torch.ones(len(encoded), length, dtype=torch.long)
    lexical = torch.randn(len(layout.option_token_ids), 64)
    with torch.no_grad():
        logits = head(hidden, mask, lexical, layout)
        gold = torch.distributions.Categorical(logits=2.5 * logits.repeat(200, 1)).sample()
        assert logit_temperature(logits.repeat(200, 1), gold) == pytest.approx(2.5, rel=0.1)
        apply_temperature(head, 2.5)
        scaled = head(hidden, mask, lexical, layout)
    finite = torch.isfinite(logits)
    torch.testing.assert_close(scaled[finite], 2.5 * logits[finite], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="clamp of 100"):
        apply_temperature(head, 1e3)


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


def test_twins_map_questions_across_renames_and_reorders(tiny_llama: Path):
    tokenizer = ReleaseTokenizer(tiny_llama)
    for twin in twin_records(12, seed=5):
        assert set(twin.same) <= set(twin.first.request["questions"])
        assert set(twin.same.values()) <= set(twin.second.request["questions"])
        for a, b in twin.same.items():  # the same question, maybe renamed, with the same label
            assert twin.first.request["questions"][a] == twin.second.request["questions"][b]
            assert twin.first.labels.get(a) == twin.second.labels.get(b)
        encoded = [e for e, _ in encode_examples(tokenizer, [twin.first, twin.second], 4096)]
        rows = twin_rows([0, 1], encoded, {0: (1, twin.same)})
        assert len(rows) == len(twin.same)
        first_q, second_q = encoded[0].questions, encoded[1].questions
        for a, b in rows:
            assert twin.same[first_q[a].question_id] == second_q[b - len(first_q)].question_id


def test_full_views_ask_a_choice_over_the_whole_universe_with_the_prompts_own_option_tokens(tiny_llama: Path):
    tokenizer = ReleaseTokenizer(tiny_llama)
    intents = banking77_intents()
    examples = training_examples(banking77=8, nlupp=0, seed=4, max_options=6)
    pairs = encode_examples(tokenizer, examples, 4096)
    encoded, gold = [e for e, _ in pairs], [g for _, g in pairs]
    means = [torch.zeros(len(e.questions), 64).numpy() for e in encoded]
    table = LexicalTable(torch.randn(tokenizer.vocab_size, 64))
    questions, rows_of = build_questions(tokenizer, encoded, gold, means, table, universe=intents)
    choices = [(n, j) for n, e in enumerate(encoded) for j, q in enumerate(e.questions) if q.question_type == 1]
    assert int(questions.full_view.sum()) == len(choices) == len(examples)
    full = encode_request(tokenizer, validate_request(banking77_request("x", intents)))  # the evaluation's question
    expected = table.lookup(full, 0)
    for n, j in choices:
        view = rows_of[n][j] + 1  # a question's view follows it
        assert bool(questions.full_view[view])
        assert questions.options[view][:77].tolist() == expected
        assert sorted(intents)[int(questions.gold[view])] == examples[n].labels[encoded[n].questions[j].question_id]


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


def test_question_means_are_the_whole_records_and_cached_by_block(tiny_llama: Path, tmp_path: Path, monkeypatch):
    """Means over records cut after their last question span equal those of the whole records' pass (causal
    attention); a cached block is read, not computed again, and a bad one is named."""
    import torch.nn.functional as F

    import clef_local.backends.torch_backend as torch_backend

    tokenizer = ReleaseTokenizer(tiny_llama)
    encoded = [e for e, _ in encode_examples(tokenizer, training_examples(banking77=3, nlupp=2, seed=2), 4096)]
    first = question_means(tiny_llama, encoded[:4], tmp_path, block_records=2)
    whole = cache_hidden_states(tiny_llama, encoded[:4], tmp_path / "whole")
    for record, means, hidden in zip(encoded, first, whole, strict=False):
        normed = F.layer_norm(hidden.float(), hidden.shape[-1:])
        expected = torch.stack([normed[a:b].mean(0) for a, b in (q.question_span for q in record.questions)])
        torch.testing.assert_close(torch.from_numpy(means), expected, rtol=0, atol=0.05)  # the BF16 cache's noise

    def no_backbone(*_args, **_kwargs):
        raise AssertionError("a cached block was computed again")

    monkeypatch.setattr(torch_backend, "TorchBackbone", no_backbone)
    again = question_means(tiny_llama, encoded[:4], tmp_path, block_records=2)
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    bad = sorted(tmp_path.glob("means-*"))[0]
    bad.write_bytes(bad.read_bytes()[:30])
    with pytest.raises(RuntimeError, match=bad.name):
        question_means(tiny_llama, encoded[:4], tmp_path, block_records=2)


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


def test_the_default_run_is_the_shipped_heads_recipe(tmp_path: Path, monkeypatch):
    """``train-head --backbone DIR --out HEAD`` trains with the MODEL_CARD's recipe: its data, 4 epochs of 16
    records at lr 3e-4, 0.1 x the state-attention term, the 77-way prompt once per BANKING77 training row."""
    from clef_local.training import state_path_train

    card = (Path(__file__).parents[1] / "clef_local" / "demo" / "head" / "MODEL_CARD.md").read_text()
    assert "clef-local train-head --backbone DIR --out HEAD`" in card.replace("\n", " ").replace("  ", " ")
    recipe = TrainConfig()
    assert (recipe.banking77, recipe.nlupp, recipe.twins, recipe.max_options, recipe.hard_negatives,
            recipe.canonical) == (1500, 3316, 500, 12, 0.5, 10003)
    assert (recipe.epochs, recipe.batch_records, recipe.lr, recipe.label_smoothing, recipe.state_attention_weight,
            recipe.consistency_weight, recipe.validation, recipe.calibrate) == (4, 16, 3e-4, 0.05, 0.1, 1.0, 0.05, True)
    seen = {}

    def fake_train(backbone, examples, out, **kwargs):
        seen.update(kwargs, examples=examples)
        return {"history": [{"epoch": 4}], "calibration": {}}

    monkeypatch.setattr(state_path_train, "train", fake_train)
    assert main(["--backbone", str(tmp_path), "--out", str(tmp_path / "head")]) == 0
    assert seen["config"] == recipe and seen["work"] == tmp_path / "head.work"
    assert (len(seen["examples"]), len(seen["twins"]), len(seen["canonical"]), len(seen["universe"])) == (
        4816, 500, 10003, 77)
    assert sum(e.id.startswith("train-banking77") for e in seen["examples"]) == 1500


def test_a_jsonl_run_caches_then_trains_and_writes_a_head(tiny_llama: Path, tmp_path: Path, capsys):
    rows = [{"request": e.request, "labels": e.labels} for e in training_examples(banking77=8, nlupp=6, seed=1)]
    data = tmp_path / "requests.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--backbone", str(tiny_llama), "--out", str(tmp_path / "head"), "--data", str(data), "--width", "32",
            "--feedforward", "64", "--epochs", "1", "--distractor-records", "3", "--validation", "0.3"]
    assert main([*argv, "--cache-only"]) == 0
    assert not (tmp_path / "head").exists()
    assert {p.name for p in (tmp_path / "head.work").iterdir()} == {"states", "distractors", "question-means"}
    capsys.readouterr()
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["epoch"] == 1 and "temperature" in printed["calibration"]
    log = json.loads((tmp_path / "head" / "training_log.json").read_text())
    assert log["examples"] == 14 and log["twins"] == log["canonical"] == 0
    assert log["config"] == asdict(TrainConfig(width=32, feedforward=64, epochs=1, distractor_records=3,
                                               validation=0.3))


@pytest.mark.parametrize("argv, message", [
    (["--hard-negatives", "50"], "--hard-negatives is a share in [0, 1], got 50"),
    (["--validation", "1"], "--validation is a share in [0, 1), got 1"),
    (["--epochs", "0"], "--epochs must be positive, got 0"),
    (["--twins", "-1"], "--twins must be ≥ 0, got -1"),
    (["--max-options", "1"], "--max-options must be at least 2"),
    (["--data", "requests.jsonl", "--banking77", "8", "--canonical", "0"], "--banking77, --canonical: settings of"),
    (["--data", "missing.jsonl"], "--data missing.jsonl: no such file"),
    (["--records", "8"], "--records: only with --adapters"),
    (["--max-steps", "3"], "--max-steps: only with --adapters"),
    (["--init", "head"], "--init: only with --adapters"),
    (["--method", "state-path"], "unrecognized arguments: --method"),
    (["--adapters", "r=16", "--epochs", "2"], "--epochs: not used by --adapters"),
    (["--adapters", "r=16", "--cache-only"], "--cache-only: not used by --adapters"),
    (["--adapters", "r=16", "--data", "requests.jsonl"], "--adapters trains on the decision data"),
    (["--adapters", "r=0"], "--adapters: rank ≥ 1"),
    (["--adapters", "r=16,targets=mlp"], "--adapters: 'targets=mlp' is not one of"),
    (["--adapters", "r=16", "--max-steps", "0"], "--max-steps must be positive, got 0"),
])
def test_train_head_refuses_what_it_cannot_honour_in_one_line(tmp_path: Path, capsys, argv: list[str],
                                                               message: str):
    (tmp_path / "requests.jsonl").write_text(json.dumps({"request": {"state": "x", "questions": {}}, "labels": {}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--backbone", str(tmp_path), "--out", str(tmp_path / "out"),
              *[str(tmp_path / a) if a == "requests.jsonl" else a for a in argv]])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and message in error, error
    assert not (tmp_path / "out").exists()


def test_every_setting_is_a_flag_whose_help_is_its_reason(capsys):
    from dataclasses import fields

    from clef_local.training.adapter_train import AdapterConfig

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in [*fields(TrainConfig), *fields(AdapterConfig)]:
        assert f.metadata["why"], f.name
        if f.name not in ("rank", "alpha", "adapter_layers"):  # --adapters r=N,alpha=X,layers=N sets those
            assert (f"--no-{f.name}" if f.type == "bool" else f"--{f.name}").replace("_", "-") in text
    assert "--method" not in text and "export/" not in text and "demo_model" not in text


def test_data_reads_what_data_convert_writes_and_names_a_bad_line(tmp_path: Path, capsys) -> None:
    from clef_local.data.jsonl import read_jsonl, write_jsonl

    examples = training_examples(banking77=3, nlupp=2, seed=1)
    converted, wrapped = tmp_path / "converted.jsonl", tmp_path / "wrapped.jsonl"
    write_jsonl(examples, converted)  # data convert's lines: the request's fields, id and labels
    wrapped.write_text("".join(json.dumps({"request": e.request, "labels": e.labels}) + "\n" for e in examples))
    for path in (converted, wrapped):
        read = read_jsonl(path)
        assert [(e.request, e.labels) for e in read] == [(e.request, e.labels) for e in examples]
    assert [e.id for e in read_jsonl(converted)] == [e.id for e in examples]
    with converted.open("a") as f:
        f.write('{"state": "x", "questions": {}}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["--backbone", str(tmp_path), "--out", str(tmp_path / "out"), "--data", str(converted)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and f"{converted}:{len(examples) + 1}" in error and '"questions"' in error
