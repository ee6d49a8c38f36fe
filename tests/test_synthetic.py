"""Synthetic releases of any shape and stored format (clef_local.testing.build_shaped_release, clef_local.synthetic):
the layout a real export has, bytes the planner predicts exactly, deterministic, and loadable."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_local
from clef_local import synthetic
from clef_local.formats.manifest import read_manifest, verify
from clef_local.formats.release import find_weight_files, read_json
from clef_local.formats.safetensors import read_header
from clef_local.planning.census import census_from_config, census_from_release
from clef_local.planning.planner import packaged_config
from clef_local.testing import build_shaped_release

SHORT_REQUEST = {"model": "clef", "state": "My card was charged twice.",
                 "questions": {"refund": {"type": "noul", "instructions": "Money back?"},
                               "team": {"type": "choice", "criteria": {"cards": None, "transfers": None}}}}
ROLES = ("quantized_linears", "text_other", "embed_tokens", "lm_head", "vision")


@pytest.fixture(scope="module")
def tiny_config(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny release's config.json and head config, as a config to shape releases from."""
    folder = tmp_path_factory.mktemp("tiny-config")
    shutil.copyfile(tiny_qwen / "config.json", folder / "config.json")
    shutil.copyfile(tiny_qwen / "joint_head_config.json", folder / "joint_head_config.json")
    return folder / "config.json"


@pytest.fixture(scope="module")
def shaped(tiny_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shaped")
    return {s: build_shaped_release(tiny_config, root / s, scheme=s, seed=3) for s in synthetic.SCHEMES}


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for file in find_weight_files(path):
        out.update({n: (t.shape, t.dtype) for n, t in read_header(file).tensors.items()})
    return out


def test_bf16_layout_is_what_save_pretrained_writes(shaped: dict[str, Path], tiny_qwen: Path) -> None:
    assert _header(shaped["bf16"]) == _header(tiny_qwen)  # names, shapes and dtypes of every tensor
    assert {p.name for p in tiny_qwen.iterdir()} <= {p.name for p in shaped["bf16"].iterdir()}
    assert read_header(shaped["bf16"] / "joint_head.safetensors").tensors.keys() == \
        read_header(tiny_qwen / "joint_head.safetensors").tensors.keys()


@pytest.mark.parametrize("scheme", synthetic.SCHEMES)
def test_stored_bytes_are_what_the_planner_predicts(shaped: dict[str, Path], scheme: str) -> None:
    path = shaped[scheme]
    stored = census_from_release(path, find_weight_files(path), read_json(path / "config.json"))
    formula = census_from_config(path / "config.json", scheme, head_config_path=path / "joint_head_config.json")
    assert stored.fmt == scheme
    assert {r: getattr(stored, r) for r in ROLES} == {r: getattr(formula, r) for r in ROLES}
    assert stored.layers == formula.layers and len(stored.layers) == 4
    assert stored.head_stored == formula.head
    assert verify(path) == []  # every SHA-256 computed while writing matches the file


@pytest.mark.parametrize("scheme", synthetic.SCHEMES)
def test_every_scheme_loads_and_decides(shaped: dict[str, Path], scheme: str) -> None:
    model = clef_local.load(shaped[scheme], dtype="float32")
    described = model.describe()
    if scheme != "bf16":
        manifest = read_manifest(shaped[scheme])
        # 3 linear-attention layers × (in_proj_qkv, in_proj_z, out_proj) + q/k/v/o + 4 × (gate, up, down)
        assert manifest is not None and len(manifest["quantized"]) == 25
        assert sum(described["kernels"].values()) == len(manifest["quantized"])
    response = model.decide(SHORT_REQUEST)
    refund = response["answers"]["refund"]["noul"]
    team = response["answers"]["team"]["probabilities"]
    assert 0 < refund < 1 and abs(sum(team.values()) - 1) < 1e-6
    assert all(0 < p < 1 for p in team.values())


def test_quantized_values_dequantize_to_the_init_scale(tiny_config: Path, tmp_path: Path) -> None:
    """Wide layers (a config of hidden 512) so the statistics are tight: zero mean, the config's
    initializer_range as standard deviation, and int4's biases exactly -8 · scales (a grid tinygemm repacks
    exactly), with both signs."""
    from clef_local import quant

    config = read_json(tiny_config)
    config["text_config"].update(hidden_size=512, intermediate_size=1024)
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps(config))
    (tmp_path / "wide" / "joint_head_config.json").write_text(json.dumps(
        {**read_json(tiny_config.parent / "joint_head_config.json"), "hidden_size": 512}))
    name = "model.language_model.layers.0.mlp.gate_proj"
    for scheme in ("int4", "int8", "fp8", "nf4"):
        out = build_shaped_release(tmp_path / "wide" / "config.json", tmp_path / scheme, scheme=scheme,
                                   layers=1, vocab_size=1024)
        from safetensors.torch import load_file

        state = load_file(str(find_weight_files(out)[0]))
        packed = {k.removeprefix(name + "."): v for k, v in state.items() if k.startswith(name + ".")}
        group = 64 if scheme in ("int4", "nf4") else None
        weight = quant.get(scheme).dequantize(packed, group, torch.float32)
        assert weight.shape == (1024, 512)
        assert abs(float(weight.mean())) < 0.002, scheme
        assert 0.018 < float(weight.std()) < 0.022, (scheme, float(weight.std()))
        if scheme == "int4":
            assert torch.equal(packed["biases"].float(), -8 * packed["scales"].float())
            assert (packed["scales"] > 0).any() and (packed["scales"] < 0).any()


def test_deterministic_and_independent_of_the_thread_count(tiny_config: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthetic, "PIECE_BYTES", 4096)  # many pieces per tensor
    files = {}
    for label, seed, workers in (("a", 0, 1), ("b", 0, 3), ("c", 1, 2)):
        out = build_shaped_release(tiny_config, tmp_path / label, scheme="int4", seed=seed, workers=workers)
        manifest = read_manifest(out)
        assert manifest is not None
        files[label] = {k: v["sha256"] for k, v in manifest["files"].items() if k.endswith(".safetensors")}
    assert files["a"] == files["b"]
    assert all(files["a"][k] != files["c"][k] for k in files["a"])


def test_shards_and_index(tiny_config: Path, tmp_path: Path) -> None:
    out = build_shaped_release(tiny_config, tmp_path / "sharded", scheme="int8", shard_bytes=100_000)
    index = read_json(out / "model.safetensors.index.json")
    shards = find_weight_files(out)
    assert len(shards) >= 3 and all(f.stat().st_size <= 100_000 + 20_000 for f in shards[:-1])
    assert index["metadata"]["total_size"] == sum(t.nbytes for f in shards for t in read_header(f).tensors.values())
    assert set(index["weight_map"]) == set(_header(out))
    assert clef_local.load(out, dtype="float32").decide(SHORT_REQUEST)["answers"]["refund"]["type"] == "noul"


def test_refusals(tiny_config: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        build_shaped_release(tiny_config, tmp_path / "full")
    with pytest.raises(ValueError, match="unknown scheme 'int3'"):
        build_shaped_release(tiny_config, tmp_path / "a", scheme="int3")
    with pytest.raises(ValueError, match="int4 group_size must be one of"):
        build_shaped_release(tiny_config, tmp_path / "b", scheme="int4", group_size=256)
    with pytest.raises(ValueError, match="layers must be between 1 and 4"):
        build_shaped_release(tiny_config, tmp_path / "c", layers=5)
    with pytest.raises(ValueError, match="vocab_size 256 is smaller than the tokenizer's ids"):
        build_shaped_release(tiny_config, tmp_path / "d", vocab_size=256)


@pytest.mark.slow
def test_clef_27b_shaped_int4_loads_and_answers_on_cpu(tmp_path: Path) -> None:
    """Clef 27B's own layer shapes (hidden 5120, MLP 17,408, 24 heads, gated delta net 16/48 heads), 4 layers (three
    linear-attention, one full attention), a 1,024-token vocabulary: int4 all the way through the loader and the
    real 128M-parameter head, and the planner's formulas equal the bytes written."""
    started = time.perf_counter()
    out = build_shaped_release(packaged_config("clef"), tmp_path / "clef-int4", scheme="int4", layers=4,
                               vocab_size=1024)
    built = time.perf_counter() - started
    stored = census_from_release(out, find_weight_files(out), read_json(out / "config.json"))
    formula = census_from_config(out / "config.json", "int4", head_config_path=out / "joint_head_config.json")
    assert {r: getattr(stored, r) for r in ROLES} == {r: getattr(formula, r) for r in ROLES}
    assert stored.quantized_linears == 855_244_800 and stored.head_stored == 512_225_296
    model = clef_local.load(out, dtype="bfloat16")
    described = model.describe()
    assert described["kernels"] == {"int4:int4pack_cpu": 25}
    assert model.backend.backbone.model.config.get_text_config().hidden_size == 5120
    response = model.decide(SHORT_REQUEST)
    probabilities = np.array(list(response["answers"]["team"]["probabilities"].values()))
    assert np.isfinite(probabilities).all() and math.isclose(probabilities.sum(), 1, abs_tol=1e-6)
    print(f"Clef-27B-shaped int4, 4 layers: built in {built:.1f} s, loaded and decided in "
          f"{time.perf_counter() - started - built:.1f} s")


def test_unhashed_weights_still_check_and_load(tiny_config: Path, tmp_path: Path) -> None:
    out = build_shaped_release(tiny_config, tmp_path / "fast", scheme="int4", hashes=False)
    manifest = read_manifest(out)
    assert manifest is not None
    entries = manifest["files"]
    assert "sha256" not in entries["model.safetensors"] and "sha256" not in entries["joint_head.safetensors"]
    assert "sha256" in entries["config.json"] and verify(out) == []
    assert clef_local.load(out, dtype="float32").decide(SHORT_REQUEST)["answers"]["refund"]["type"] == "noul"
