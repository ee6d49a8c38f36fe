"""The state-path head (``clef-local train-head``): a choice's field ignores its question span, a run writes a
release head that computes what training computed, and a killed run resumes to the same bytes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import clef_local
from clef_local.data.datasets import banking77_examples, banking77_intents
from clef_local.formats.release import read_json
from clef_local.heads.torch_head import HeadConfig, JointSchemaHead
from clef_local.runtime.layout import build_layout
from clef_local.runtime.schema import TYPE_IDS
from clef_local.runtime.tokenizer import ReleaseTokenizer
from clef_local.training.config import TrainConfig
from clef_local.training.demo_data import training_examples, twin_records
from clef_local.training.records import encode_examples
from clef_local.training.state_path import (
    CHOICE_DOMINANCE,
    PRIOR_OFF,
    Distractors,
    StateBatch,
    batch_layout,
    state_logits,
    state_path_head,
    zeroed_parameters,
)
from clef_local.training.state_path_train import CHECKPOINT, train

SMALL = TrainConfig(width=32, heads=4, feedforward=64, epochs=2, batch_records=6, distractor_records=4,
                    canonical_distractors=2, validation=0.2)


def _random_state_path_head(seed: int = 0) -> JointSchemaHead:
    torch.manual_seed(seed)
    head = JointSchemaHead(HeadConfig(hidden_size=64, width=32, routing_layers=1, layers=2, heads=4, feedforward=64))
    trainable = state_path_head(head, 1.0)
    with torch.no_grad():  # away from the init, so the test sees every trainable tensor
        for param in trainable:
            param.add_(0.3 * torch.randn_like(param))
    return head.eval()


def test_the_layout_of_a_batch_counts_slots_within_each_record():
    layout = batch_layout(torch.tensor([0, 0, 1, 2, 2]), torch.tensor([1, 0, 2, 1, 1]),
                          torch.tensor([0, 0, 1, 1, 2, 3, 3, 4]), torch.tensor([0, 1, 0, 1, 0, 0, 1, 0]))
    assert layout.question_slot.tolist() == [0, 1, 0, 0, 1]
    assert layout.option_record.tolist() == [0, 0, 0, 0, 1, 2, 2, 2]
    assert layout.option_record_slot.tolist() == [0, 1, 2, 3, 0, 0, 1, 2]
    assert (layout.max_options, layout.max_options_per_record, layout.max_questions_per_record) == (2, 4, 2)


def test_a_choice_field_ignores_its_question_span_and_a_noul_does_not():
    """Type dominance: a different span mean moves a noul's logits, and a choice's by < 1e-3 of their size."""
    head = _random_state_path_head(seed=3)
    torch.manual_seed(1)
    layout = batch_layout(torch.zeros(2, dtype=torch.long), torch.tensor([TYPE_IDS["noul"], TYPE_IDS["choice"]]),
                          torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1, 0, 1, 2]))
    memory, lexical = torch.randn(1, 20, 64), torch.randn(5, 64)
    pad, state = torch.zeros(1, 20, dtype=torch.bool), torch.ones(1, 20, dtype=torch.bool)
    with torch.no_grad():
        first, mass = state_logits(head, StateBatch(memory, pad, state, torch.randn(2, 64), lexical, layout))
        second, _ = state_logits(head, StateBatch(memory, pad, state, torch.randn(2, 64), lexical, layout))
    noul, choice = (first - second)[0, :2].abs().max(), (first - second)[1].abs().max()
    assert float(noul) > 1e-2
    assert float(choice) < 1e-3 * float(first[1].abs().max())
    assert torch.allclose(mass, torch.ones(5, 1))  # every token is state here: all the mass is on it
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert "type_embedding.parametrizations.weight.original" in trainable and "prior_logit_scale" not in trainable
    assert not any(n.startswith("layers.") for n in trainable)  # the field layers' outputs are zero: all frozen


def test_distractors_are_stretches_of_the_bank():
    bank = [torch.arange(40, dtype=torch.float32)[:, None], torch.arange(100, 103, dtype=torch.float32)[:, None]]
    rng = random.Random(0)
    for _ in range(50):
        piece = Distractors(bank, min_tokens=16).draw(rng)[:, 0]
        assert len(piece) >= 3
        assert bool((piece[1:] - piece[:-1] == 1).all())  # contiguous
    with pytest.raises(ValueError, match="empty"):
        Distractors([])


@pytest.fixture(scope="module")
def trained(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list]:
    root = tmp_path_factory.mktemp("state-path")
    examples = training_examples(banking77=10, nlupp=6, seed=3, max_options=6)
    result = train(tiny_llama, examples, root / "head", work=root / "work", config=SMALL,
                   twins=twin_records(3, seed=1), universe=banking77_intents(),
                   canonical=banking77_examples("train", limit=6))
    return root, result, examples


def test_a_run_writes_a_release_head_of_the_state_path(trained) -> None:
    root, result, _ = trained
    out = root / "head"
    state = load_file(str(out / "joint_head.safetensors"))
    head = JointSchemaHead(HeadConfig(**json.loads((out / "joint_head_config.json").read_text())))
    head.load_state_dict(state, strict=True)
    assert all(not bool(state[name].any()) for name in zeroed_parameters(head))
    assert float(state["prior_logit_scale"]) < PRIOR_OFF + 2  # off (the temperature's log is added to it)
    assert bool(state["evidence_layers.0.attention.out_proj.weight"].any())  # routing is live: it reads the state
    rows = state["type_embedding.weight"].norm(dim=-1)
    assert float(rows[TYPE_IDS["choice"]]) > CHOICE_DOMINANCE / 100 * float(rows[TYPE_IDS["noul"]])
    assert [h["epoch"] for h in result["history"]] == [1, 2]
    last = result["history"][-1]
    assert 0 < last["val_state_mass"] <= 1 and "val_accuracy_full_views" in last
    assert 0.25 <= result["calibration"]["temperature"] <= 4.0
    assert {p.name for p in (root / "work").iterdir()} == {"states", "distractors", "question-means", CHECKPOINT}
    log = json.loads((out / "training_log.json").read_text())
    assert log["canonical"] == 6 and log["config"] == dataclasses.asdict(SMALL)


def test_the_saved_head_computes_what_training_computed(trained, tiny_llama: Path) -> None:
    """The last checkpoint is the head as training ran it (choice row multiplied on the fly, no temperature): its
    training logits on whole records, times the folded temperature, are what the released head answers."""
    from clef_local.backends.torch_backend import TorchBackbone, collate

    root, result, examples = trained
    backbone_config = read_json(tiny_llama / "config.json")
    head = JointSchemaHead(SMALL.head_config(int(backbone_config["hidden_size"])))
    state_path_head(head, 0.0)
    head.load_state_dict(torch.load(root / "work" / CHECKPOINT, weights_only=False)["head"])
    head.eval()

    requests = [e.request for e in examples[8:]] + [examples[0].request]  # NLU++ nouls and scores, a choice
    encoded = [e for e, _ in encode_examples(ReleaseTokenizer(tiny_llama), examples[8:] + examples[:1], 4096)]
    backbone = TorchBackbone(tiny_llama, backbone_config, dtype=torch.float32)
    ids, mask = collate(encoded, 0, torch.device("cpu"))
    layout = build_layout(encoded, ids.shape[1]).map(torch.from_numpy)
    with torch.no_grad():
        hidden = backbone.forward(ids, mask)
        flat = F.layer_norm(hidden, hidden.shape[-1:]).reshape(-1, hidden.shape[-1])
        means = torch.stack([flat[row * ids.shape[1] + a : row * ids.shape[1] + b].mean(0)
                             for row, record in enumerate(encoded) for a, b in (q.question_span for q in
                                                                               record.questions)])
        rows = backbone.lexical_rows(layout.option_token_ids)
        offsets = layout.option_token_offsets.tolist()
        lexical = torch.stack([rows[a:b].mean(0) for a, b in itertools.pairwise(offsets)])
        state = torch.zeros_like(mask, dtype=torch.bool)
        for n, r in enumerate(encoded):
            state[n, : r.state_start + r.state_tokens] = True
        logits, _ = state_logits(head, StateBatch(hidden, mask == 0, state, means, lexical, layout))
        expected = torch.softmax(logits * result["calibration"]["temperature"], -1)

    release = root / "release"
    shutil.copytree(tiny_llama, release)
    for name in ("joint_head.safetensors", "joint_head_config.json"):
        shutil.copyfile(root / "head" / name, release / name)
    model = clef_local.load(release, dtype="float32")
    got = [p for prediction in model.predict(requests) for p in prediction.probabilities]
    assert {TYPE_IDS["noul"], TYPE_IDS["choice"], TYPE_IDS["score"]} <= set(layout.question_type.tolist())
    assert len(got) == len(expected)
    for row, probabilities in enumerate(got):
        torch.testing.assert_close(torch.from_numpy(probabilities), expected[row, : len(probabilities)],
                                   rtol=0, atol=2e-5)
    assert float(expected.max()) > 0.3  # the head says something: the comparison is not of uniform answers
    assert set(model.decide(requests[0])["answers"]) == set(requests[0]["questions"])


def test_an_interrupted_run_resumes_to_the_same_bytes(tiny_llama: Path, tmp_path: Path, monkeypatch):
    from clef_local.training import state_path_train

    examples = training_examples(banking77=8, nlupp=4, seed=5, max_options=5)
    kwargs = {"config": SMALL, "twins": twin_records(2, seed=2), "universe": banking77_intents()}
    train(tiny_llama, examples, tmp_path / "whole", work=tmp_path / "work-whole", **kwargs)

    real_save = state_path_train.save_checkpoint

    def save_then_die(*args, **kw):
        real_save(*args, **kw)
        raise KeyboardInterrupt  # killed right after the first epoch's checkpoint

    monkeypatch.setattr(state_path_train, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_llama, examples, tmp_path / "resumed", work=tmp_path / "work", **kwargs)
    assert not (tmp_path / "resumed").exists()
    monkeypatch.setattr(state_path_train, "save_checkpoint", real_save)
    steps: list[int] = []
    real_step = state_path_train.optimizer_step
    monkeypatch.setattr(state_path_train, "optimizer_step", lambda *a, **kw: steps.append(1) or real_step(*a, **kw))
    result = train(tiny_llama, examples, tmp_path / "resumed", work=tmp_path / "work", **kwargs)
    assert steps and [h["epoch"] for h in result["history"]] == [1, 2]  # the second epoch only was trained
    whole = (tmp_path / "whole" / "joint_head.safetensors").read_bytes()
    assert (tmp_path / "resumed" / "joint_head.safetensors").read_bytes() == whole
    other = {**kwargs, "config": dataclasses.replace(SMALL, lr=SMALL.lr / 2)}
    with pytest.raises(ValueError, match=r"other settings \(lr: .* delete it"):
        train(tiny_llama, examples, tmp_path / "other", work=tmp_path / "work", **other)
