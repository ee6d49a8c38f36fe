"""train-head --adapters (clef_local.training.adapter_train): LoRA adapters and a whole-record head trained
together, resumable to the same bytes, written as head files + an adapter that the demo build merges into a release
whose backbone computes what the adapted model computed and whose answers are the trained model's."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import clef_local
from clef_local.backends.torch_backend import TorchBackbone, collate
from clef_local.demo import build
from clef_local.demo.adapter import ADAPTER_FILE, read_adapter
from clef_local.formats.manifest import sha256
from clef_local.formats.release import read_json
from clef_local.testing import build_tiny_release
from clef_local.training.adapter_train import AdapterConfig, AdapterModel, train_adapters
from clef_local.training.decision_data import DecisionMix, decision_data
from clef_local.training.train_head import main

CONFIG = AdapterConfig(records=10, rank=2, alpha=4, adapter_layers=1, batch_records=4, width=32, heads=2,
                       feedforward=64, lr=5e-3, head_lr=5e-3, validation=0.2, checkpoint_steps=1)
HEAD_FILES = ("joint_head.safetensors", "joint_head_config.json")


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny release stored in float32: the merge then rounds nothing, and the merged backbone must compute what
    the adapted one did to float32 noise."""
    return build_tiny_release(tmp_path_factory.mktemp("tiny32") / "llama", backbone="llama", seed=1,
                              dtype=torch.float32)


@pytest.fixture(scope="module")
def trained(backbone: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("adapters")
    examples, twins = decision_data(CONFIG.records, DecisionMix(twins=0.5))
    log = train_adapters(backbone, examples, twins, root / "out", work=root / "work", config=CONFIG,
                         dtype=torch.float32)
    return root, log


def _trainer(backbone: Path, out: Path) -> AdapterModel:
    """The training forward with the written head and adapter factors (float32, LoRA modules, eval mode)."""
    model = AdapterModel(backbone, CONFIG, "cpu", init=out, dtype=torch.float32)
    adapter = read_adapter(out / ADAPTER_FILE)
    with torch.no_grad():
        for name, (a, b) in adapter.factors.items():
            model.adapted[name].lora_A.copy_(a)
            model.adapted[name].lora_B.copy_(b)
    model.train(False)
    return model


def test_training_writes_a_whole_record_head_and_an_adapter_of_the_asked_shape(trained) -> None:
    root, log = trained
    out = root / "out"
    assert {p.name for p in out.iterdir()} == {*HEAD_FILES, "training_log.json", ADAPTER_FILE}
    adapter = read_adapter(out / ADAPTER_FILE)
    assert adapter.rank == 2 and adapter.scale == 2.0
    assert len(adapter.factors) == 7 and all(".layers.1." in name for name in adapter.factors)  # the top layer
    assert all(float(b.abs().max()) > 0 for _, b in adapter.factors.values())  # B started at 0 and moved
    head = load_file(str(out / "joint_head.safetensors"))
    for live in ("option_context_projection.weight", "global_projection.weight", "layers.0.linear2.weight",
                 "option_summary_norm.weight"):  # every branch of a whole-record head trains
        assert bool(head[live].any()), live
    assert json.loads((out / "joint_head_config.json").read_text())["width"] == 32
    assert np.isfinite(log["validation"]["val_loss"]) and log["steps"] == log["planned_steps"] >= 2
    assert 0.25 <= log["calibration"]["temperature"] <= 4.0


def test_the_demo_build_merges_it_into_a_release_that_computes_what_training_did(
        trained, backbone: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packaged as the demo head (head files + adapter + their hashes), the build merges the adapter into the
    converted backbone: the merged backbone's hidden states are the adapted model's, and the release loaded with
    clef_local.load answers what the training forward answers."""
    from clef_local.demo import backbone as demo_backbone

    root, _ = trained
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    for name in (*HEAD_FILES, ADAPTER_FILE):
        shutil.copyfile(root / "out" / name, packaged / name)
    (packaged / "MODEL_CARD.md").write_text("# a trained head\n")
    (packaged / "hashes.json").write_text(json.dumps({n: sha256(packaged / n) for n in (*HEAD_FILES, ADAPTER_FILE)}))

    def convert(gguf: Path, out: Path) -> dict:  # the "converted GGUF": the float32 tiny backbone
        out.mkdir(parents=True, exist_ok=True)
        for item in backbone.iterdir():
            if item.name not in (*HEAD_FILES, "clef_local_manifest.json"):
                shutil.copy2(item, out / item.name)
        return {}

    monkeypatch.setattr(build, "_packaged", lambda: packaged)
    monkeypatch.setattr(demo_backbone, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(demo_backbone, "convert_backbone", convert)
    release = build.demo_path(tmp_path / "cache")
    assert (release / ADAPTER_FILE).read_bytes() == (root / "out" / ADAPTER_FILE).read_bytes()

    examples, _ = decision_data(6, DecisionMix(twins=0.0), seed=5)
    model = clef_local.load(release, dtype="float32")
    predictions = model.predict([copy.deepcopy(e.request) for e in examples])
    records = [p.encoded for p in predictions]
    trainer = _trainer(backbone, root / "out")
    merged = TorchBackbone(release, read_json(release / "config.json"), dtype=torch.float32)
    plain = TorchBackbone(backbone, read_json(backbone / "config.json"), dtype=torch.float32)
    ids, mask = collate(records, 0, torch.device("cpu"))
    with torch.no_grad():
        adapted = trainer.backbone.text_model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(merged.forward(ids, mask), adapted, rtol=1e-5, atol=1e-5)
        assert float((plain.forward(ids, mask) - adapted).abs().max()) > 1e-3  # the adapter changes the backbone
        logits, _ = trainer.forward(records)
    expected = torch.softmax(logits, -1).numpy()
    got = [p for prediction in predictions for p in prediction.probabilities]
    assert len(got) == len(expected)
    for row, probabilities in enumerate(got):
        np.testing.assert_allclose(probabilities, expected[row, : len(probabilities)], rtol=0, atol=1e-5)
    assert set(model.decide(examples[0].request)["answers"]) == set(examples[0].request["questions"])


def test_a_run_cut_by_max_steps_resumes_to_the_same_bytes(trained, backbone: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    root, log = trained
    examples, twins = decision_data(CONFIG.records, DecisionMix(twins=0.5))
    cut = train_adapters(backbone, examples, twins, tmp_path / "cut", work=tmp_path / "work", config=CONFIG,
                         max_steps=1, dtype=torch.float32)
    assert (cut["steps"], [h["step"] for h in cut["history"]]) == (1, [1])
    with caplog.at_level(logging.INFO, logger="clef_local.training.adapter_train"):
        whole = train_adapters(backbone, examples, twins, tmp_path / "whole", work=tmp_path / "work", config=CONFIG,
                               dtype=torch.float32)
    assert "resuming at step 1 " in caplog.text
    assert whole["steps"] == log["steps"] and [h["step"] for h in whole["history"]] == [1, log["steps"]]
    # as if it had never stopped: the same head bytes, the same adapter factors (the adapter file's metadata order
    # is the safetensors writer's hash-map order, so its bytes are compared tensor by tensor)
    head = "joint_head.safetensors"
    assert (tmp_path / "whole" / head).read_bytes() == (root / "out" / head).read_bytes()
    resumed, uninterrupted = read_adapter(tmp_path / "whole" / ADAPTER_FILE), read_adapter(root / "out" / ADAPTER_FILE)
    assert (resumed.rank, resumed.scale, resumed.factors.keys()) == (uninterrupted.rank, uninterrupted.scale,
                                                                     uninterrupted.factors.keys())
    assert all(torch.equal(x, y) for name in resumed.factors
               for x, y in zip(resumed.factors[name], uninterrupted.factors[name], strict=True))
    with pytest.raises(ValueError, match=r"other settings \(lr: .* delete it"):
        train_adapters(backbone, examples, twins, tmp_path / "other", work=tmp_path / "work",
                       config=replace(CONFIG, lr=1e-3), dtype=torch.float32)


def test_the_command_starts_from_an_init_head_and_keeps_its_shape(backbone: Path, tmp_path: Path, capsys) -> None:
    argv = ["--backbone", str(backbone), "--out", str(tmp_path / "out"), "--adapters", "r=2,alpha=4,layers=1",
            "--records", "6", "--batch-records", "4", "--validation", "0.3", "--max-steps", "1",
            "--init", str(backbone)]
    assert main(argv) == 0
    assert "val_loss" in json.loads(capsys.readouterr().out)
    assert (tmp_path / "out" / "joint_head_config.json").read_text() == (
        backbone / "joint_head_config.json").read_text()
    log = json.loads((tmp_path / "out" / "training_log.json").read_text())
    assert (log["init"], log["steps"], log["config"]["rank"], log["config"]["records"]) == (str(backbone), 1, 2, 6)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--width", "48"])
    assert exit_info.value.code == 2 and "--width: the head in --init" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((backbone / "joint_head_config.json").read_text())
    (other / "joint_head_config.json").write_text(json.dumps({**config, "hidden_size": 99}))
    shutil.copyfile(backbone / "joint_head.safetensors", other / "joint_head.safetensors")
    from clef_local.errors import ReleaseError

    with pytest.raises(ReleaseError, match="hidden size 99"):
        main([*argv[:-1], str(other)])
