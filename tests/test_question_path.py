"""The question-path training method: its shortcut computes the full head's numbers, and it trains a release head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from path_checks import assert_forward_logits, cache_backbone
from safetensors.torch import load_file

from clef_local.data.datasets import banking77_examples, banking77_intents, banking77_request
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.encoding import encode_request
from clef_local.runtime.layout import build_layout
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import encode_examples
from clef_local.training.demo_data import training_examples, twin_records
from clef_local.training.question_path import (
    PRIOR_OFF,
    LexicalTable,
    question_means,
    question_path_head,
    question_path_logits,
    zeroed_parameters,
)
from clef_local.training.question_path_train import PathConfig, build_questions, train_question_path

SMALL = PathConfig(width=32, heads=4, feedforward=64, epochs=3, batch_questions=16)


def test_the_question_path_computes_the_full_heads_logits(tiny_llama: Path, tmp_path: Path):
    """Span means of records cut after their last question, through the shortcut, equal the released head's
    forward on the whole prompt: the method trains exactly the numbers the head will compute."""
    tokenizer = ReleaseTokenizer(tiny_llama)
    examples = training_examples(banking77=6, nlupp=4, seed=5)
    pairs = encode_examples(tokenizer, examples, 4096)
    encoded, gold = [e for e, _ in pairs], [g for _, g in pairs]
    means = question_means(tiny_llama, encoded, tmp_path / "means", block_records=4)
    torch.manual_seed(0)
    head = JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64))
    trainable = question_path_head(head, 1.0)
    with torch.no_grad():  # away from the init, so the test sees every trainable tensor
        for param in trainable:
            param.add_(0.3 * torch.randn_like(param))
    head.eval()
    backbone = cache_backbone(tiny_llama)
    table = LexicalTable(backbone.output_embedding.detach().float())
    questions, _ = build_questions(tokenizer, encoded, gold, means, table)
    with torch.no_grad():
        shortcut = question_path_logits(head, questions.batch(torch.arange(len(questions.gold)), table.tensor())[0])

    from clef_local.backends.torch_backend import collate

    ids, mask = collate(encoded, 0, torch.device("cpu"))
    with torch.no_grad():
        hidden = backbone.hidden_states(ids, mask)
        layout = build_layout(encoded, ids.shape[1]).map(torch.from_numpy)
        full = head(hidden, mask, backbone.lexical_rows(layout.option_token_ids), layout)
    assert_forward_logits(full, shortcut)


def test_question_means_are_cached_by_block_and_a_bad_block_is_named(tiny_llama: Path, tmp_path: Path, monkeypatch):
    tokenizer = ReleaseTokenizer(tiny_llama)
    encoded = [e for e, _ in encode_examples(tokenizer, training_examples(banking77=5, nlupp=0, seed=2), 4096)]
    first = question_means(tiny_llama, encoded[:4], tmp_path, block_records=2)
    assert [m.shape for m in first] == [(len(e.questions), 64) for e in encoded[:4]]

    import clef_local.backends.torch_backend as torch_backend

    def no_backbone(*_args, **_kwargs):
        raise AssertionError("a cached block was computed again")

    monkeypatch.setattr(torch_backend, "TorchBackbone", no_backbone)
    again = question_means(tiny_llama, encoded[:4], tmp_path, block_records=2)
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    bad = sorted(tmp_path.glob("means-*"))[0]
    bad.write_bytes(bad.read_bytes()[:30])
    with pytest.raises(RuntimeError, match=bad.name):
        question_means(tiny_llama, encoded[:4], tmp_path, block_records=2)


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
    full = encode_request(tokenizer, banking77_request("x", intents))  # the evaluation's 77-way question
    expected = table.lookup(full, 0)
    for n, j in choices:
        view = rows_of[n][j] + 1  # a question's view follows it
        assert bool(questions.full_view[view])
        assert questions.options[view][:77].tolist() == expected
        assert sorted(intents)[int(questions.gold[view])] == examples[n].labels[encoded[n].questions[j].question_id]


def test_train_question_path_writes_a_release_head_with_its_other_branches_zero(tiny_llama: Path, tmp_path: Path):
    import clef_local

    examples = training_examples(banking77=24, nlupp=12, seed=3, max_options=6)
    out = tmp_path / "head"
    result = train_question_path(tiny_llama, examples, out, work=tmp_path / "work", config=SMALL,
                                 twins=twin_records(6), universe=banking77_intents(), validation=0.25,
                                 canonical=banking77_examples("train", limit=4))
    history = result["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert {"val_accuracy_full_views", "val_twin_mean_dp"} <= set(history[-1])
    weights = load_file(str(out / "joint_head.safetensors"))
    assert all(float(weights[name].abs().max()) == 0 for name in zeroed_parameters(
        JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64))))
    assert float(weights["prior_logit_scale"]) == PRIOR_OFF
    assert float(weights["question_projection.weight"].abs().max()) > 0
    logged = json.loads((out / "training_log.json").read_text())
    assert logged["method"] == "question-path" and logged["canonical"] == 4
    assert 0.25 <= logged["calibration"]["temperature"] <= 4  # fitted on the validation questions, folded in
    assert logged["units"] == 36 + 6 + 4  # a record, a twin's two records, a canonical record: one unit each

    release = tmp_path / "release"  # the head drops into a release and loads strictly
    release.mkdir()
    for item in tiny_llama.iterdir():
        if not item.name.startswith("joint_head"):
            (release / item.name).symlink_to(item)
    for name in ("joint_head.safetensors", "joint_head_config.json"):
        (release / name).write_bytes((out / name).read_bytes())
    model = clef_local.load(release, dtype="float32")
    answer = model.decide(examples[0].request)
    assert set(answer["answers"]) == set(examples[0].request["questions"])


def test_a_fine_tune_keeps_the_split_trains_a_share_and_weights_the_canonical_prompt(tiny_llama: Path,
                                                                                      tmp_path: Path):
    examples = training_examples(banking77=24, nlupp=12, seed=3, max_options=6)
    canonical = banking77_examples("train", limit=8)
    kwargs = {"twins": twin_records(6), "universe": banking77_intents(), "validation": 0.25, "canonical": canonical}
    first = train_question_path(tiny_llama, examples, tmp_path / "head", work=tmp_path / "work", config=SMALL,
                                **kwargs)
    config = PathConfig(**{**SMALL.__dict__, "share": 0.5, "canonical_weight": 3.0, "epochs": 1, "calibrate": False})
    tuned = train_question_path(tiny_llama, examples, tmp_path / "tuned", work=tmp_path / "work-tuned",
                                config=config, init=tmp_path / "head", **kwargs)
    assert tuned["init"] == str(tmp_path / "head") and tuned["config"]["canonical_weight"] == 3.0
    assert tuned["validation_units"] == first["validation_units"]
    before = load_file(str(tmp_path / "head" / "joint_head.safetensors"))
    after = load_file(str(tmp_path / "tuned" / "joint_head.safetensors"))
    assert float(after["prior_logit_scale"]) == PRIOR_OFF  # still a question-path head
    assert all(float(after[name].abs().max()) == 0 for name in zeroed_parameters(
        JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64))))
    assert float((after["question_projection.weight"] - before["question_projection.weight"]).abs().max()) > 0
    # a share of the other units: the fine-tune's cache holds the validation and the chosen records only
    cached = sum(len(load_file(str(block))) for block in (tmp_path / "work-tuned" / "question-means").iterdir())
    assert tuned["validation_units"] <= cached < len(examples) + 2 * 6 + len(canonical)
    # in the first run's work directory the fine-tune reads its cache and computes nothing
    blocks = sorted((tmp_path / "work" / "question-means").iterdir())
    again = train_question_path(tiny_llama, examples, tmp_path / "again", work=tmp_path / "work", config=config,
                                init=tmp_path / "head", **kwargs)
    assert sorted((tmp_path / "work" / "question-means").iterdir()) == blocks
    assert again["validation_units"] == first["validation_units"]


def test_init_refuses_a_head_that_is_not_a_question_path_head(tiny_llama: Path, tmp_path: Path):
    from clef_local.errors import ReleaseError

    with pytest.raises(ReleaseError, match="not a question-path head"):
        train_question_path(tiny_llama, training_examples(banking77=4, nlupp=0, seed=3), tmp_path / "out",
                            work=tmp_path / "work", config=SMALL, init=tiny_llama)


@pytest.mark.parametrize(("argv", "message"), [
    (["--spliced", "8"], "--spliced: not used by --method question-path"),
    (["--autocast", "bf16"], "--autocast: not used by --method question-path"),
    (["--share", "1.5"], "--share is a share in (0, 1]"),
    (["--canonical-weight", "0"], "--canonical-weight must be positive"),
    (["--label-smoothing", "1"], "--label-smoothing is in [0, 1)"),
])
def test_question_path_refuses_the_full_methods_options(tmp_path: Path, capsys, argv: list[str], message: str):
    from clef_local.training.train_head import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--backbone", str(tmp_path), "--out", str(tmp_path / "out"), "--method", "question-path", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_full_method_refuses_the_question_paths_options(tmp_path: Path, capsys):
    from clef_local.training.train_head import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--backbone", str(tmp_path), "--out", str(tmp_path / "out"), "--canonical-weight", "3"])
    assert exit_info.value.code == 2 and "belong to --method question-path" in capsys.readouterr().err


def test_a_fitted_temperature_is_recovered_and_folded_into_the_heads_weights():
    from clef_local.training.question_path import apply_temperature
    from clef_local.training.question_path_train import Questions, fit_temperature

    torch.manual_seed(1)
    head = JointSchemaHead(HeadConfig(hidden_size=16, width=8, routing_layers=1, layers=1, heads=2, feedforward=16))
    question_path_head(head, 1.0)
    n, k = 4000, 5
    lexical = torch.randn(k, 16)
    questions = Questions(torch.randn(n, 16), torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                          torch.arange(k).repeat(n, 1), torch.zeros(n, dtype=torch.bool))
    rows = torch.arange(n)
    with torch.no_grad():
        logits = question_path_logits(head, questions.batch(rows, lexical)[0])
    questions.gold = torch.distributions.Categorical(logits=2.5 * logits).sample()  # labels drawn at temperature 2.5
    assert fit_temperature(head, questions, [[r] for r in range(n)], lexical) == pytest.approx(2.5, rel=0.1)
    apply_temperature(head, 2.5)
    with torch.no_grad():
        scaled = question_path_logits(head, questions.batch(rows, lexical)[0])
    assert torch.allclose(scaled, 2.5 * logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="clamp of 100"):
        apply_temperature(head, 1e3)
