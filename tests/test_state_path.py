"""The state-path training method: its training math is the released head's, a choice's field ignores its question
span, and a run writes a release head."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from path_checks import assert_forward_logits, cache_backbone
from safetensors.torch import load_file

from clef_local.data.datasets import banking77_examples, banking77_intents
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.layout import build_layout
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.common import encode_examples
from clef_local.training.demo_data import training_examples, twin_records
from clef_local.training.head_losses import question_loss
from clef_local.training.question_path import PRIOR_OFF, LexicalTable, question_means
from clef_local.training.question_path_train import build_questions
from clef_local.training.state_path import (
    CHOICE_DOMINANCE,
    PathBatch,
    StateBatch,
    batch_layout,
    dominate_choices,
    fold_choice_dominance,
    fold_dominance,
    fold_whitening,
    path_logits,
    state_path_head,
    state_path_logits,
    twin_whitening,
    zeroed_parameters,
)
from clef_local.training.state_path_train import Distractors, StatePathConfig, make_batch, prepare, train_state_path

SMALL = StatePathConfig(width=32, heads=4, feedforward=64, epochs=2, batch_records=6, distractor_records=4,
                        canonical_distractors=2)


def _random_state_path_head(seed: int = 0) -> JointSchemaHead:
    torch.manual_seed(seed)
    head = JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64))
    trainable = state_path_head(head, 1.0)
    with torch.no_grad():  # away from the init, so the test sees every trainable tensor
        for param in trainable:
            param.add_(0.3 * torch.randn_like(param))
    return head.eval()


def _whole_record_batch(encoded, hidden, mask, questions, table) -> StateBatch:
    """A StateBatch whose memory is each record's own hidden states, every token (what the released head reads)."""
    rows = torch.arange(len(questions.gold))
    record_of = torch.tensor([n for n, r in enumerate(encoded) for _ in r.questions])
    options = questions.options[rows]
    question, slot = (options >= 0).nonzero(as_tuple=True)
    used, option_lexical = options[question, slot].unique(return_inverse=True)
    option_record = record_of[question]
    record_slot = torch.zeros_like(option_record)
    counts = [0] * len(encoded)
    for n, record in enumerate(option_record.tolist()):
        record_slot[n], counts[record] = counts[record], counts[record] + 1
    state_mask = torch.zeros_like(mask, dtype=torch.bool)
    for n, r in enumerate(encoded):
        state_mask[n, : r.state_start + r.state_tokens] = True
    return StateBatch(hidden.float(), mask == 0, state_mask, questions.means, questions.types, record_of, question,
                      slot, option_record, record_slot, table.tensor()[used], option_lexical,
                      int((options >= 0).sum(-1).max()), max(counts))


@pytest.mark.parametrize("whiten", [False, True])
def test_the_state_path_computes_the_full_heads_logits(tiny_llama: Path, tmp_path: Path, whiten: bool):
    """On whole records, the training math (choice row multiplied on the fly, span means whitened) equals the
    released head's forward once both are folded into the weights; the attention mass on prefix + state is a share
    of each query."""
    tokenizer = ReleaseTokenizer(tiny_llama)
    pairs = encode_examples(tokenizer, training_examples(banking77=6, nlupp=4, seed=5), 4096)
    encoded, gold = [e for e, _ in pairs], [g for _, g in pairs]
    means = question_means(tiny_llama, encoded, tmp_path / "means", block_records=4)
    backbone = cache_backbone(tiny_llama)
    table = LexicalTable(backbone.output_embedding.detach().float())
    questions, _ = build_questions(tokenizer, encoded, gold, means, table)
    assert {0, 1}.issubset(set(questions.types.tolist()))

    from clef_local.backends.torch_backend import collate

    ids, mask = collate(encoded, 0, torch.device("cpu"))
    head = _random_state_path_head()
    transform = None
    if whiten:  # any symmetric map folds the same way; a random one tests the fold, not the estimate
        torch.manual_seed(4)
        noise = torch.randn(64, 64)
        transform = torch.eye(64) + 0.2 * (noise + noise.T)
        questions.means = questions.means @ transform
    with torch.no_grad():
        hidden = backbone.forward(ids, mask)
        shortcut, mass = state_path_logits(head, _whole_record_batch(encoded, hidden, mask, questions, table))
        fold_dominance(head)
        if transform is not None:
            fold_whitening(head, transform)
        layout = build_layout(encoded, ids.shape[1]).map(torch.from_numpy)
        full = head(hidden, mask, backbone.lexical_rows(layout.option_token_ids), layout)
    assert_forward_logits(full, shortcut)
    assert mass.shape == (int(torch.isfinite(full).sum()), 1)
    assert bool(((mass > 0) & (mass < 1)).all())


def test_a_choice_field_ignores_its_question_span_and_a_noul_does_not():
    """Type dominance: a different span mean moves a noul's logits, and a choice's by < 1e-3 of their size."""
    head = _random_state_path_head(seed=3)
    fold_dominance(head)
    hidden_size, options = 64, 3
    torch.manual_seed(1)
    base = dict(memory=torch.randn(1, 20, hidden_size), memory_pad=torch.zeros(1, 20, dtype=torch.bool),
                state_mask=torch.ones(1, 20, dtype=torch.bool),
                types=torch.tensor([TYPE_IDS["noul"], TYPE_IDS["choice"]]),
                question_record=torch.zeros(2, dtype=torch.long),
                option_question=torch.tensor([0, 0, 1, 1, 1]), option_slot=torch.tensor([0, 1, 0, 1, 2]),
                option_record=torch.zeros(5, dtype=torch.long), option_record_slot=torch.arange(5),
                lexical=torch.randn(5, hidden_size), option_lexical=torch.arange(5), max_options=options,
                max_record_options=5)
    with torch.no_grad():
        first, _ = state_path_logits(head, StateBatch(means=torch.randn(2, hidden_size), **base), dominance=1.0)
        second, _ = state_path_logits(head, StateBatch(means=torch.randn(2, hidden_size), **base), dominance=1.0)
    noul, choice = (first - second)[0, :2].abs().max(), (first - second)[1].abs().max()
    assert float(noul) > 1e-2
    assert float(choice) < 1e-3 * float(first[1].abs().max())


def test_distractors_are_stretches_of_the_bank():
    bank = [torch.arange(40, dtype=torch.float32)[:, None], torch.arange(100, 103, dtype=torch.float32)[:, None]]
    import random

    rng = random.Random(0)
    for _ in range(50):
        piece = Distractors(bank, min_tokens=16).draw(rng)[:, 0]
        assert len(piece) >= 3
        assert bool((piece[1:] - piece[:-1] == 1).all())  # contiguous
    with pytest.raises(ValueError, match="empty"):
        Distractors([])


def test_train_state_path_writes_a_release_head(tiny_llama: Path, tmp_path: Path):
    examples = training_examples(banking77=10, nlupp=6, seed=3, max_options=6)
    canonical = banking77_examples("train", limit=6)
    out = tmp_path / "head"
    result = train_state_path(tiny_llama, examples, out, work=tmp_path / "work", config=SMALL,
                              twins=twin_records(3, seed=1), universe=banking77_intents(), canonical=canonical,
                              validation=0.2)
    state = load_file(str(out / "joint_head.safetensors"))
    config = json.loads((out / "joint_head_config.json").read_text())
    head = JointSchemaHead(HeadConfig(**config))
    head.load_state_dict(state, strict=True)
    assert all(not bool(state[name].any()) for name in zeroed_parameters(head))
    assert float(state["prior_logit_scale"]) == PRIOR_OFF
    assert bool(state["evidence_layers.0.attention.out_proj.weight"].any())  # routing is live: it reads the state
    rows = state["type_embedding.weight"].norm(dim=-1)
    assert float(rows[TYPE_IDS["choice"]]) > CHOICE_DOMINANCE / 100 * float(rows[TYPE_IDS["noul"]])
    assert len(result["history"]) == SMALL.epochs
    last = result["history"][-1]
    assert 0 < last["val_state_mass"] <= 1 and "val_accuracy_full_views" in last
    assert (tmp_path / "work" / "states").is_dir() and (tmp_path / "work" / "distractors").is_dir()
    log = json.loads((out / "training_log.json").read_text())
    assert log["method"] == "state-path" and log["canonical"] == 6


@pytest.mark.parametrize("flag", [["--spliced", "4"], ["--init", "x"], ["--share", "0.5"], ["--autocast", "bf16"]])
def test_state_path_refuses_what_it_would_ignore(flag, tmp_path: Path, capsys):
    from clef_local.training.train_head import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--backbone", str(tmp_path), "--out", str(tmp_path / "o"), "--method", "state-path", *flag])
    assert exit_info.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_twin_whitening_shrinks_what_twins_disagree_on():
    """Twins differing along one direction: after the map that direction carries far less of the means' spread."""
    torch.manual_seed(0)
    base = torch.randn(200, 16)
    nuisance = torch.zeros(16)
    nuisance[3] = 1.0
    means = torch.cat([base, base + 2.0 * torch.randn(200, 1) * nuisance])
    pairs = [(i, 200 + i) for i in range(200)]
    transform = twin_whitening(means, pairs, 0.01)
    assert torch.allclose(transform, transform.T, atol=1e-5)
    before = (means[:200] - means[200:]).norm(dim=-1).mean() / means.norm(dim=-1).mean()
    after = ((means[:200] - means[200:]) @ transform).norm(dim=-1).mean() / (means @ transform).norm(dim=-1).mean()
    assert float(after) < 0.2 * float(before)
    with pytest.raises(ValueError, match="no twin pairs"):
        twin_whitening(means, [], 0.01)
    with pytest.raises(ValueError, match="positive"):
        twin_whitening(means, pairs, 0.0)


def test_an_interrupted_state_path_run_resumes_to_the_same_head(tiny_llama: Path, tmp_path: Path, monkeypatch):
    from clef_local.training import state_path_train

    examples = training_examples(banking77=8, nlupp=4, seed=5, max_options=5)
    kwargs = {"config": SMALL, "twins": twin_records(2, seed=2), "universe": banking77_intents(), "validation": 0.2}
    steps: list[int] = []
    real_step = state_path_train.optimizer_step

    def counted_step(*args, **kw):
        steps.append(1)
        return real_step(*args, **kw)

    monkeypatch.setattr(state_path_train, "optimizer_step", counted_step)
    train_state_path(tiny_llama, examples, tmp_path / "whole", work=tmp_path / "work-whole", **kwargs)
    whole_steps = len(steps)

    real_save = state_path_train.save_checkpoint

    def save_then_die(*args, **kw):
        real_save(*args, **kw)
        raise KeyboardInterrupt  # killed right after the first epoch's checkpoint

    monkeypatch.setattr(state_path_train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_state_path(tiny_llama, examples, tmp_path / "resumed", work=tmp_path / "work", **kwargs)
    assert not (tmp_path / "resumed").exists()
    monkeypatch.setattr(state_path_train, "save_checkpoint", real_save)
    steps.clear()
    result = train_state_path(tiny_llama, examples, tmp_path / "resumed", work=tmp_path / "work", **kwargs)
    assert len(steps) == whole_steps // 2  # the second epoch only
    assert [h["epoch"] for h in result["history"]] == [1, 2]
    whole = load_file(str(tmp_path / "whole" / "joint_head.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "joint_head.safetensors"))
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    other = {**kwargs, "config": dataclasses.replace(SMALL, lr=SMALL.lr / 2)}
    with pytest.raises(ValueError, match=r"other settings \(lr: .* delete it"):
        train_state_path(tiny_llama, examples, tmp_path / "other", work=tmp_path / "work", **other)


def test_the_heads_own_logits_compute_the_old_state_path_math(tiny_llama: Path, tmp_path: Path):
    """``head.logits`` on HeadInputs built from the cached pieces, with the choice row dominated by a
    parametrization, gives the old re-derived math's logits, attention masses and gradients (float32)."""
    import copy
    import random

    examples = training_examples(banking77=8, nlupp=6, seed=3, max_options=6)
    data = prepare(tiny_llama, examples, tmp_path / "work", SMALL, twin_records(3, seed=1), "cpu",
                   banking77_intents(), banking77_examples("train", limit=4), 0.2)
    head = _random_state_path_head(seed=2).train()
    head.hidden_norm = torch.nn.LayerNorm(64)  # a random affine norm: the means' affine map is exercised too
    with torch.no_grad():
        head.hidden_norm.weight.normal_(1.0, 0.3)
        head.hidden_norm.bias.normal_(0.0, 0.3)
    new_head = copy.deepcopy(head)
    dominate_choices(new_head)
    rng = random.Random(0)
    worst = {"logits": 0.0, "mass": 0.0, "grad": 0.0}
    units = [unit for unit in data.split.fit + data.split.val]
    for start in range(0, len(units), 6):
        rows = [r for unit in units[start : start + 6] for r in unit]
        old, target = make_batch(rows, data.questions, data.split, data.memories, data.lexical, data.distractors, rng)
        layout = batch_layout(old.question_record, old.types, old.option_question, old.option_slot)
        assert torch.equal(layout.option_record, old.option_record)
        assert torch.equal(layout.option_record_slot, old.option_record_slot)
        new = PathBatch(old.memory, old.memory_pad, old.state_mask, old.means, old.lexical[old.option_lexical],
                        layout)
        for model in (head, new_head):
            model.zero_grad()
        old_logits, old_mass = state_path_logits(head, old)
        new_logits, new_mass = path_logits(new_head, new)
        finite = torch.isfinite(old_logits)
        assert torch.equal(finite, torch.isfinite(new_logits)) and float(old_logits.detach()[finite].std()) > 0.1
        worst["logits"] = max(worst["logits"], float((old_logits - new_logits).detach()[finite].abs().max()))
        with torch.no_grad():  # and in eval mode, where the field layers take the inference kernels
            head.eval(), new_head.eval()
            (old_eval, _), (new_eval, _) = state_path_logits(head, old), path_logits(new_head, new)
            head.train(), new_head.train()
        worst["logits"] = max(worst["logits"], float((old_eval - new_eval)[finite].abs().max()))
        worst["mass"] = max(worst["mass"], float((old_mass - new_mass).detach().abs().max()))
        for logits, mass in ((old_logits, old_mass), (new_logits, new_mass)):
            (question_loss(logits, target, 0.05, 1.0) - mass.clamp_min(1e-9).log().mean()).backward()
        # the old math never ran the field layers (their outputs are zero): no gradient there, a zero one now
        old_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad
                     for n, p in head.named_parameters() if p.requires_grad}
        new_grads = {n.replace("parametrizations.weight.original", "weight"): p.grad
                     for n, p in new_head.named_parameters() if p.requires_grad}
        assert old_grads.keys() == new_grads.keys()
        for name, grad in old_grads.items():
            scale = max(float(grad.abs().max()), 1e-3)
            worst["grad"] = max(worst["grad"], float((grad - new_grads[name]).abs().max()) / scale)
    print("old vs new state path, worst:", worst)
    assert worst["logits"] <= 1e-5 and worst["mass"] <= 1e-6 and worst["grad"] <= 1e-5
    fold_choice_dominance(new_head)
    fold_dominance(head)
    assert torch.equal(new_head.type_embedding.weight, head.type_embedding.weight)
    assert set(new_head.state_dict()) == set(head.state_dict())
