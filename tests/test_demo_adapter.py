"""The demo backbone's adapter (clef_local.demo.adapter): the factors trained as LoRA modules
(clef_local.training.lora) merge deterministically into the BF16 weights at build, and the merged release is a plain
Clef-layout release that the reference implementation reads to the same probabilities."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import clef_local
from clef_local.demo import build
from clef_local.demo.adapter import ADAPTER_FILE, lora_delta, merge_adapter, read_adapter, save_adapter
from clef_local.errors import ReleaseError
from clef_local.formats.manifest import sha256
from clef_local.training.lora import AdapterSpec, LoraLinear, adapter_factors, add_adapters

REQUESTS = [
    {"model": "m", "state": "I was charged twice for my coffee.",
     "questions": {"refund": {"type": "noul", "instructions": "Does the customer want money back?"},
                   "team": {"type": "choice", "criteria": {"cards": "Card payments", "transfers": None}},
                   "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}},
    {"model": "m", "state": "Where is my new card?",
     "questions": {"q7": {"type": "noul", "criteria": {"true": "the card has not arrived"}}}},
]


def _trained_adapter(release: Path, spec: AdapterSpec, seed: int = 3) -> tuple[dict, torch.nn.Module]:
    """LoRA modules on the release's backbone with random (non-zero) factors, as training would leave them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32)
    adapted = add_adapters(model, spec, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in adapted.values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * 0.05)
    return adapted, model


def test_the_spec_parses_the_flag_and_names_bad_values() -> None:
    assert AdapterSpec.parse("r=16") == AdapterSpec(rank=16)
    spec = AdapterSpec.parse("r=8,alpha=16,layers=0")
    assert (spec.rank, spec.scale, spec.layers, spec.targets) == (8, 2.0, 0, AdapterSpec().targets)
    for bad in ("r=0", "rank", "r=x", "targets=attention", "dropout=0.1"):
        with pytest.raises(ValueError, match="--adapters"):
            AdapterSpec.parse(bad)


def test_factors_round_trip_and_the_delta_is_the_same_bits_on_any_thread_count(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 24, generator=generator), torch.randn(16, 4, generator=generator)
    save_adapter(tmp_path / ADAPTER_FILE, {"model.layers.0.mlp.up_proj": (a, b)}, rank=4, scale=2.0)
    adapter = read_adapter(tmp_path / ADAPTER_FILE)
    (name, (a2, b2)), = adapter.factors.items()
    assert name == "model.layers.0.mlp.up_proj" and adapter.scale == 2.0 and adapter.rank == 4
    assert torch.equal(a2, a) and torch.equal(b2, b)
    delta = lora_delta(a, b, 2.0)
    torch.testing.assert_close(delta, 2.0 * b @ a, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lora_delta(a, b, 2.0), delta)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="rank 8"):
        save_adapter(tmp_path / "bad.safetensors", {"x": (a, b)}, rank=8, scale=1.0)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"x.lora_A": a}, str(other), metadata={"format": "peft"})
    with pytest.raises(ReleaseError, match="not a clef-local adapter"):
        read_adapter(other)


def test_the_merged_release_computes_what_the_adapted_model_did_and_the_reference_agrees(
        oracle, tiny_llama: Path, tmp_path: Path) -> None:
    release = tmp_path / "merged"
    shutil.copytree(tiny_llama, release)
    spec = AdapterSpec(rank=4, alpha=8, layers=1)
    adapted, model = _trained_adapter(release, spec)
    assert all(isinstance(m, LoraLinear) for m in adapted.values()) and len(adapted) == 7
    save_adapter(tmp_path / ADAPTER_FILE, adapter_factors(adapted), rank=4, scale=spec.scale)
    before = load_file(release / "model.safetensors")
    assert merge_adapter(release / "model.safetensors", tmp_path / ADAPTER_FILE) == 7
    after = load_file(release / "model.safetensors")
    assert set(after) == set(before)
    for name, tensor in after.items():
        assert tensor.dtype == before[name].dtype
        changed = name.removesuffix(".weight") in adapted
        assert changed != torch.equal(tensor, before[name]), name
        if changed:  # exactly the widened weight plus the delta, rounded once to the stored dtype
            a, b = adapted[name.removesuffix(".weight")].lora_A, adapted[name.removesuffix(".weight")].lora_B
            expected = (before[name].float() + lora_delta(a.detach(), b.detach(), spec.scale)).to(tensor.dtype)
            assert torch.equal(tensor, expected)
    # the adapted model (LoRA modules, float32) and the merged release see the same hidden states, up to the
    # weights' rounding to their stored dtype
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    merged_model = type(model).from_pretrained(release, dtype=torch.float32)
    with torch.no_grad():
        adapted_hidden = model.model(input_ids=ids).last_hidden_state
        merged_hidden = merged_model.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(merged_hidden, adapted_hidden, rtol=0.05, atol=0.05)
    assert not torch.allclose(merged_hidden, type(model).from_pretrained(tiny_llama, dtype=torch.float32).model(
        input_ids=ids).last_hidden_state, atol=1e-3)  # the merge changed what the backbone computes

    # a plain release: clef-local and the reference implementation (its own loader and head class) agree on it
    ours = clef_local.load(release, dtype="float32").predict(copy.deepcopy(REQUESTS))
    for request, prediction in zip(REQUESTS, ours, strict=True):
        for mine, theirs in zip(prediction.probabilities, _reference_probabilities(oracle, release, request),
                                strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-5)


def _reference_probabilities(oracle, path: Path, request: dict) -> list[np.ndarray]:
    import transformers

    backbone = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head = oracle.JointSchemaHead(**json.loads((path / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(path / "joint_head.safetensors"), strict=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = oracle.ClefModel(backbone, head.float()).eval()
    encoded = oracle.encode_record(tokenizer, copy.deepcopy(request))
    batch = oracle.collate_records([encoded], tokenizer.pad_token_id, torch.device("cpu"))
    with torch.inference_mode():
        logits = model(batch)[0]
    return [q.float().softmax(-1).numpy() for q in logits]


def test_the_demo_build_merges_the_packaged_adapter_and_rebuilds_when_it_changes(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clef_local.demo import backbone

    packaged = tmp_path / "packaged"
    packaged.mkdir()
    for name in (*build.HEAD_FILES, "MODEL_CARD.md"):
        source = tiny_llama / name if (tiny_llama / name).is_file() else None
        (packaged / name).write_bytes(source.read_bytes() if source else b"# card\n")
    adapted, _ = _trained_adapter(tiny_llama, AdapterSpec(rank=2, alpha=2, layers=1))
    save_adapter(packaged / ADAPTER_FILE, adapter_factors(adapted), rank=2, scale=1.0)

    def write_hashes() -> None:
        names = [*build.HEAD_FILES, ADAPTER_FILE]
        (packaged / "hashes.json").write_text(json.dumps({n: sha256(packaged / n) for n in names}))

    write_hashes()
    conversions: list[Path] = []

    def convert(gguf: Path, out: Path) -> dict:
        conversions.append(out)
        out.mkdir(parents=True, exist_ok=True)
        for item in tiny_llama.iterdir():
            if item.name not in (*build.HEAD_FILES, "clef_local_manifest.json"):
                shutil.copy2(item, out / item.name)
        return {}

    monkeypatch.setattr(build, "_packaged", lambda: packaged)
    monkeypatch.setattr(backbone, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(backbone, "convert_backbone", convert)
    target = build.demo_path(tmp_path / "cache")
    merged = load_file(target / "model.safetensors")
    plain = load_file(tiny_llama / "model.safetensors")
    changed = sorted(n for n in merged if not torch.equal(merged[n], plain[n]))
    assert changed == sorted(f"{n}.weight" for n in adapted)
    assert (target / ADAPTER_FILE).read_bytes() == (packaged / ADAPTER_FILE).read_bytes()
    assert build.demo_path(tmp_path / "cache") == target and len(conversions) == 1  # verified, not rebuilt

    save_adapter(packaged / ADAPTER_FILE, {n: (a, b * 2) for n, (a, b) in adapter_factors(adapted).items()},
                 rank=2, scale=1.0)
    write_hashes()
    assert build.demo_path(tmp_path / "cache") == target and len(conversions) == 2  # another adapter: rebuilt
    again = load_file(target / "model.safetensors")
    assert sorted(n for n in again if not torch.equal(again[n], merged[n])) == changed
    assert not list((tmp_path / "cache").glob(".*"))  # the old build moved aside was removed
