"""Checkpoints written by compressed-tensors' own compressors (as llm-compressor saves them) load in clef-local.

llm-compressor itself pins an older transformers, so the checkpoints are written here the way it writes them:
``apply_quantization_config`` with the ``FP8_DYNAMIC`` / ``W8A8`` presets (lm_head ignored), per-channel weight scales
from ``calculate_qparams`` on each row's min/max (what its min-max observer computes), ``compress_model``
and ``update_config``. Their ``weight_scale`` is stored in the model's dtype (bf16), not clef-local's float32: the
loader widens it, exactly.

Tolerance: transformers' ``dequantize=True`` rounds ``q · scale`` to the scale's dtype (bf16; asserted exactly on a
layer below) while clef-local keeps it in float32, so their last hidden states agree to bf16 weight rounding: max
|Δ| ≤ 1e-2 × max |reference| (measured 2e-3). clef-local's MLX backend vs its torch backend: max |Δp| ≤ 1e-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_local
from clef_local.backends.quantized import QuantizedLinear

pytest.importorskip("compressed_tensors")

PRESETS = {"fp8": ("FP8_DYNAMIC", "float-quantized"), "int8": ("W8A8", "int-quantized")}
IDS = torch.tensor(np.random.default_rng(1).integers(3, 200, (2, 12)))
MASK = torch.ones_like(IDS)


def write_checkpoint(source: Path, out: Path, preset: str, fmt: str) -> Path:
    """The backbone of the release at ``source`` quantized and saved by compressed-tensors, the head copied beside."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            weight = module.weight.data.float()
            scale, _ = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), scheme.weights)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for file in source.iterdir():  # tokenizer, head and legal files; the weights are the compressor's
        if not (out / file.name).exists() and not file.name.startswith(("model", "clef_local_manifest")):
            shutil.copyfile(file, out / file.name)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    return {scheme: write_checkpoint(tiny_llama, root / scheme, *preset) for scheme, preset in PRESETS.items()}


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_a_compressed_tensors_checkpoint_loads_and_matches_transformers(checkpoints, scheme):
    import transformers
    from safetensors.torch import load_file

    path = checkpoints[scheme]
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert "clef_local" not in config and config["format"] == PRESETS[scheme][1]
    stored = load_file(path / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    model = clef_local.load(path, dtype="float32", backend="torch")
    assert model.describe()["format"] == {"scheme": scheme, "group_size": None,
                                          "layout": f"compressed-tensors {PRESETS[scheme][1]}",
                                          "written_by": "compressed-tensors"}
    layer = model.backend.backbone.text_model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantizedLinear)
    q, scale = stored["model.layers.0.self_attn.q_proj.weight"], stored["model.layers.0.self_attn.q_proj.weight_scale"]
    exact = q.float() * scale.float()
    torch.testing.assert_close(layer.dequantize(torch.float32), exact, rtol=0, atol=0)  # widened exactly
    ours = model.backend.backbone.forward(IDS, MASK).numpy()

    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    torch.testing.assert_close(theirs.model.layers[0].self_attn.q_proj.weight, exact.bfloat16().float(), rtol=0,
                               atol=0)  # transformers rounds q · scale to bf16
    with torch.inference_mode():
        reference = theirs.model(input_ids=IDS, attention_mask=MASK).last_hidden_state.numpy()
    assert np.abs(ours - reference).max() <= 1e-2 * np.abs(reference).max()


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_the_mlx_backend_reads_it_like_the_torch_backend(checkpoints, probes_small, scheme):
    pytest.importorskip("mlx.core")
    path = checkpoints[scheme]
    a = [p for r in clef_local.load(path, dtype="float32", backend="torch").predict(probes_small) for p in
         r.probabilities]
    b = [p for r in clef_local.load(path, dtype="float32", backend="mlx").predict(probes_small) for p in
         r.probabilities]
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True)) <= 1e-4


@pytest.fixture(scope="module")
def probes_small() -> list[dict]:
    from clef_local.data.probes import probe_requests

    return probe_requests(4, seed=7)
