"""The ecosystem's vision conversions read here: ``mlx_vlm.convert -q`` of a tiny vision release (Qwen3.5 with its
vision tower) loads on the torch backend (images and text) and the MLX backend (text: it runs no vision tower), and
answers like clef-local's own int4 of the same weights (docs/quantization.md#the-ecosystems-variants-read-here).

What mlx-vlm writes, asserted below: MLX's tensor layout (``language_model.model.`` / ``vision_tower.`` names,
channels-last conv1d and patch embedding, RMSNorm weights plus 1), the vision tower unquantized, every text linear
quantized (the gated-delta ``in_proj_a`` / ``in_proj_b`` too, which clef-local keeps) and the embeddings, a config
with ``quantization`` = ``quantization_config`` = ``{"group_size", "bits", "mode"}`` and no per-module entry, and its
own ``Qwen3VLImageProcessor`` nested in ``processor_config.json``. Tolerances, float32: torch vs MLX on the conversion
max |Δp| ≤ 1e-4; the conversion vs clef-local's int4 max |Δp| ≤ 0.05 with and without images (the int4 embeddings,
the int4 ``in_proj_a`` / ``in_proj_b`` and the norms rounded to BF16 at 1 + w differ; the measured values are in
docs/benchmarks.md#variants-in-the-ecosystems-tools).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from media_gen import data_uri, image

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_vlm", reason="mlx-vlm is not installed (pip install mlx-vlm); it writes the conversion")

import clef_local
from clef_local.errors import ApiUsageError, ReleaseError
from clef_local.formats.mlx_layout import release_name
from clef_local.formats.safetensors import read_arrays
from clef_local.formats.variant import variant_format

GROUP = 64
HEAD_FILES = ("joint_head.safetensors", "joint_head_config.json")
BLOCK = {"group_size": GROUP, "bits": 4, "mode": "affine"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, tiny_vision: Path) -> Path:
    """The tiny vision release with random RMSNorm weights (built at zero, which 1 + w in BF16 keeps exactly)."""
    import torch
    from safetensors.torch import load_file, save_file

    out = shutil.copytree(tiny_vision, tmp_path_factory.mktemp("mlx-vlm-source") / "release")
    tensors = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name, value in tensors.items():
        if name.endswith("norm.weight") and not name.startswith("model.visual."):
            tensors[name] = (value.float() + 0.3 * torch.randn(value.shape, generator=generator)).to(value.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, source: Path) -> tuple[Path, Path]:
    """(mlx-vlm's conversion of ``source`` with its Clef head, clef-local's int4 of it, mlx grid)."""
    from mlx_vlm.convert import convert

    from clef_local.export.quantize import quantize_release

    root = tmp_path_factory.mktemp("mlx-vlm")
    # without a weights index mlx-vlm loads every *.safetensors of the directory, the head's too ("Received 72
    # parameters not in model"): it converts the backbone's files alone, and the head travels beside the result
    backbone = root / "backbone"
    shutil.copytree(source, backbone, ignore=shutil.ignore_patterns(*HEAD_FILES))
    converted = root / "mlx-vlm-4bit"
    convert(str(backbone), str(converted), quantize=True, q_group_size=GROUP, q_bits=4)
    for name in HEAD_FILES:
        shutil.copyfile(source / name, converted / name)
    ours = root / "clef-local-int4"
    quantize_release(source, ours, "int4", GROUP, validate=False, int4_grid="mlx", log_summary=False)
    return converted, ours


@pytest.fixture(scope="module")
def requests() -> tuple[list[dict], list[dict]]:
    """(6 text probes, 3 of them with an image each)."""
    from clef_local.data.probes import probe_requests

    text = probe_requests(6, seed=5)
    return text, [dict(r, images=[data_uri(image(64 + 16 * i, 64, seed=i))]) for i, r in enumerate(text[:3])]


def _probabilities(path: Path, backend: str, requests: list[dict]) -> list[np.ndarray]:
    model = clef_local.load(path, backend=backend, dtype="float32", device="cpu")
    return [p for r in model.predict(requests, batch_size=4) for p in r.probabilities]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_what_mlx_vlm_writes_and_how_it_is_read(pair, source, requests):
    from tokenizers import Tokenizer

    converted, ours = pair
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization"] == config["quantization_config"] == BLOCK  # no per-module entries
    fmt = variant_format(config)
    assert fmt.to_json() == {"scheme": "int4", "group_size": GROUP, "layout": "mlx affine", "written_by": "mlx-vlm"}
    stored = {k: v for f in converted.glob("model*.safetensors") for k, v in read_arrays(f).items()}
    assert all(k.startswith(("language_model.", "vision_tower.")) for k in stored)
    vision = [k for k in stored if k.startswith("vision_tower.")]
    assert len(vision) == 21 and not [k for k in vision if k.endswith(".scales")]  # the vision tower as released
    assert stored["vision_tower.patch_embed.proj.weight"].shape == (32, 2, 16, 16, 3)  # channels last
    theirs = {release_name(k): v for k, v in stored.items()}
    mine = read_arrays(ours / "model.safetensors")
    quantized = {k.removesuffix(".scales") for k in theirs if k.endswith(".scales")}
    kept = {k.removesuffix(".scales") for k in mine if k.endswith(".scales")}
    assert kept < quantized and sorted(quantized - kept) == sorted(
        ["lm_head", "model.language_model.embed_tokens"]
        + [f"model.language_model.layers.{i}.linear_attn.in_proj_{p}" for i in range(3) for p in "ab"])
    for prefix in kept:  # the linears both quantize: the same bits
        for part in ("weight", "scales", "biases"):
            np.testing.assert_array_equal(theirs[f"{prefix}.{part}"], mine[f"{prefix}.{part}"])
    nested = json.loads((converted / "processor_config.json").read_text())["image_processor"]
    assert nested["image_processor_type"] == "Qwen3VLImageProcessor"  # mlx-vlm's class; transformers has none
    assert (converted / "preprocessor_config.json").read_bytes() == (source / "preprocessor_config.json").read_bytes()
    texts = [json.dumps(r) for r in requests[0]] + ["<|vision_start|><|image_pad|><|vision_end|> café 🖥️"]
    a, b = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (source, converted))
    assert [a.encode(t).ids for t in texts] == [b.encode(t).ids for t in texts]  # transformers re-saved it


def test_the_torch_backbone_holds_the_releases_tensors(pair, source):
    """The layout restored: the vision tower, conv1d and the gated norms exactly the release's, the RMSNorms within
    BF16's rounding of 1 + w (mlx-vlm adds 1 in BF16), the int4 embeddings dequantized into the compute dtype."""
    converted, _ = pair
    release = clef_local.load(source, backend="torch", dtype="float32").backend.backbone.model.state_dict()
    model = clef_local.load(converted, backend="torch", dtype="float32").backend.backbone.model
    loaded = model.state_dict()
    vision = [k for k in release if k.startswith("model.visual.")]
    conv = [k for k in release if k.endswith("conv1d.weight")]
    gated = [k for k in release if k.endswith("linear_attn.norm.weight")]  # plain w in both: not offset
    assert (len(vision), len(conv), len(gated)) == (21, 3, 3)
    for name in vision + conv + gated:
        assert loaded[name].shape == release[name].shape and bool((loaded[name] == release[name]).all()), name
    norms = [k for k in release if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))
             or k == "model.language_model.norm.weight"]
    assert len(norms) == 11
    errors = [float((loaded[k] - release[k]).abs().max()) for k in norms]
    assert 0 < max(errors) <= 2.0**-8  # rounded once, at 1 + w in BF16 (|1 + w| < 2 here: half an ulp of 2⁻⁷)
    embed = model.get_input_embeddings().weight.detach()
    assert tuple(embed.shape) == (520, 64) and embed.element_size() == 4
    assert float((embed - release["model.language_model.embed_tokens.weight"]).abs().max()) < 0.05  # int4 rows


def test_inspect_names_mlx_vlm(pair, capsys):
    from clef_local.decide import inspect_main

    converted, _ = pair
    assert inspect_main(["--model", str(converted), "--dtype", "float32", "--backend", "torch"]) == 0
    assert json.loads(capsys.readouterr().out)["format"]["written_by"] == "mlx-vlm"


def test_the_conversion_answers_like_clef_locals_int4_with_and_without_images(pair, requests):
    converted, ours = pair
    text, images = requests
    torch_text = _probabilities(converted, "torch", text)
    assert _max_diff(torch_text, _probabilities(converted, "mlx", text)) <= 1e-4
    assert _max_diff(torch_text, _probabilities(ours, "torch", text)) <= 0.05
    torch_images = _probabilities(converted, "torch", images)
    assert _max_diff(torch_images, _probabilities(ours, "torch", images)) <= 0.05
    assert _max_diff(torch_images, torch_text[: len(torch_images)]) > 1e-3  # the images changed the answers
    mlx = clef_local.load(converted, backend="mlx", dtype="float32")
    with pytest.raises(ApiUsageError, match=r"mlx backend does not run the vision tower.*--backend torch"):
        mlx.predict(images[:1])


def test_a_corrupted_or_unsupported_conversion_is_refused_by_name(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    converted, _ = pair
    broken = shutil.copytree(converted, tmp_path / "conv1d")
    tensors = load_file(broken / "model.safetensors")
    name = "language_model.model.layers.0.linear_attn.conv1d.weight"
    tensors[name] = tensors[name].permute(0, 2, 1).contiguous()  # [C, 1, K]: not what mlx-vlm writes
    save_file(tensors, broken / "model.safetensors", metadata={"format": "mlx"})
    with pytest.raises(ReleaseError, match=rf"{name} is \[128, 1, 4\].*again with mlx_vlm\.convert"):
        clef_local.load(broken, backend="torch", dtype="float32")
    eight = shutil.copytree(converted, tmp_path / "eight")
    config = json.loads((eight / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {**BLOCK, "bits": 8}
    (eight / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReleaseError, match=r"mlx-vlm quantization .*mlx_vlm\.convert -q --q-bits 4"):
        clef_local.load(eight, backend="torch", dtype="float32")
    with pytest.raises(ApiUsageError, match=r"cannot be streamed from disk: its tensors are in MLX's layout .*"
                                            r"load it without offload"):
        clef_local.load(converted, dtype="float32", offload="disk")


def test_the_plan_counts_what_the_loader_holds(pair):
    """The census names the conversion's roles (lm_head, the vision tower) and counts its int4 embeddings as the
    matrices the loader dequantizes them to: in float32, the loaded tensors' bytes."""
    from clef_local.planning.estimate import held_weights
    from clef_local.planning.planner import footprint_from_release

    converted, ours = pair
    census = footprint_from_release(converted).censuses["int4"]
    own = footprint_from_release(ours).censuses["int4"]
    assert census.vision == own.vision  # the vision tower as released in both
    model = clef_local.load(converted, backend="torch", dtype="float32").backend.backbone.model
    held = held_weights(census, "float32")
    assert held.embed_tokens == model.get_input_embeddings().weight.nbytes == 520 * 64 * 4
    assert held.lm_head == model.get_output_embeddings().weight.nbytes == 520 * 64 * 4
