"""train-head --adapters (clef_local.training.adapter_train): LoRA adapters and a question-path head trained
together, resumable, written as head files + an adapter that merges into a release whose answers are the trained
model's."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_local
from clef_local.demo.adapter import ADAPTER_FILE, merge_adapter, read_adapter
from clef_local.runtime.head_reach import Reach
from clef_local.training.adapter_train import AdapterConfig, AdapterModel, train_adapters
from clef_local.training.decision_data import DecisionMix, decision_data

CONFIG = AdapterConfig(records=10, rank=2, alpha=4, adapter_layers=1, batch_records=4, width=32, heads=2,
                       feedforward=64, lr=5e-3, head_lr=5e-3, validation=0.2, checkpoint_steps=1)


@pytest.fixture(scope="module")
def trained(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("adapters")
    examples, twins = decision_data(CONFIG.records, DecisionMix(twins=0.5))
    log = train_adapters(tiny_llama, examples, twins, root / "out", work=root / "work", config=CONFIG)
    return root, tiny_llama, log


def test_training_writes_a_question_path_head_and_an_adapter_of_the_asked_shape(trained) -> None:
    root, _, log = trained
    out = root / "out"
    assert {p.name for p in out.iterdir()} == {"joint_head.safetensors", "joint_head_config.json",
                                               "training_log.json", ADAPTER_FILE}
    adapter = read_adapter(out / ADAPTER_FILE)
    assert adapter.rank == 2 and adapter.scale == 2.0
    assert len(adapter.factors) == 7 and all(".layers.1." in name for name in adapter.factors)  # the top layer
    assert any(float(b.abs().max()) > 0 for _, b in adapter.factors.values())  # B started at 0 and moved
    assert json.loads((out / "joint_head_config.json").read_text())["width"] == 32
    assert np.isfinite(log["validation"]["val_loss"]) and log["history"][-1]["step"] >= 2
    assert 0.25 <= log["calibration"]["temperature"] <= 4.0


def test_the_merged_release_answers_as_the_trained_model_did_and_reads_question_spans_only(trained) -> None:
    root, tiny_llama, _ = trained
    release = root / "release"
    shutil.copytree(tiny_llama, release)
    for name in ("joint_head.safetensors", "joint_head_config.json"):
        shutil.copyfile(root / "out" / name, release / name)
    merge_adapter(release / "model.safetensors", root / "out" / ADAPTER_FILE)
    model = clef_local.load(release, dtype="float32")
    assert model.reach is Reach.QUESTION_SPANS

    examples, _ = decision_data(6, DecisionMix(twins=0.0), seed=5)
    predictions = model.predict([e.request for e in examples])
    # the training forward with the trained factors as LoRA modules (float32 backbone, unmerged)
    trainer = AdapterModel(tiny_llama, replace(CONFIG, records=6), "cpu", root / "out")
    trainer.model.float()
    adapter = read_adapter(root / "out" / ADAPTER_FILE)
    with torch.no_grad():
        for name, (a, b) in adapter.factors.items():
            trainer.adapted[name].lora_A.copy_(a)
            trainer.adapted[name].lora_B.copy_(b)
    trainer.train(False)
    with torch.no_grad():
        logits, _ = trainer.forward([p.encoded for p in predictions])
    expected = torch.softmax(logits, -1).numpy()
    got = [p for prediction in predictions for p in prediction.probabilities]
    # the release stores BF16 weights (the merge rounds W + delta once); the trainer computed in float32
    assert max(float(np.abs(g - expected[i, : len(g)]).max()) for i, g in enumerate(got)) < 0.02


def test_a_finished_run_resumes_at_its_last_checkpoint_and_other_settings_are_refused(
        trained, caplog: pytest.LogCaptureFixture) -> None:
    root, tiny_llama, log = trained
    steps = log["history"][-1]["step"]
    examples, twins = decision_data(CONFIG.records, DecisionMix(twins=0.5))
    with caplog.at_level(logging.INFO, logger="clef_local.training.adapter_train"):
        again = train_adapters(tiny_llama, examples, twins, root / "again", work=root / "work", config=CONFIG)
    assert f"resuming at step {steps} " in caplog.text
    assert again["history"] == log["history"]  # nothing left to train; the run's history comes with its checkpoint
    first, second = read_adapter(root / "out" / ADAPTER_FILE), read_adapter(root / "again" / ADAPTER_FILE)
    assert all(torch.equal(first.factors[n][1], second.factors[n][1]) for n in first.factors)
    with pytest.raises(ValueError, match=r"other settings.*lr"):
        train_adapters(tiny_llama, examples, twins, root / "other", work=root / "work",
                       config=replace(CONFIG, lr=1e-3))


def test_a_run_cut_by_max_steps_goes_on_where_it_stopped(tiny_llama: Path, tmp_path: Path) -> None:
    examples, twins = decision_data(CONFIG.records, DecisionMix(twins=0.5))
    config = replace(CONFIG, checkpoint_steps=5)  # the cut itself is checkpointed
    cut = train_adapters(tiny_llama, examples, twins, tmp_path / "cut", work=tmp_path / "work", config=config,
                         max_steps=1)
    assert (cut["steps"], [h["step"] for h in cut["history"]]) == (1, [1])
    whole = train_adapters(tiny_llama, examples, twins, tmp_path / "whole", work=tmp_path / "work", config=config)
    assert whole["steps"] == whole["planned_steps"] == cut["planned_steps"] > 1
    assert [h["step"] for h in whole["history"]] == [1, whole["steps"]]  # resumed after step 1, its history kept
