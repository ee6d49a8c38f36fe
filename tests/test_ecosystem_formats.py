"""Variants the ecosystem reads (docs/quantization.md#what-reads-each-variant): the fp8 / int8 configs parsed by
compressed-tensors' own model and loaded by transformers, int4's ``quantization`` block read by mlx-lm; old configs
still load.

Tolerances, float32 on both sides: transformers (``CompressedTensorsConfig(dequantize=True)``) vs clef-local's
weight-only CPU path, last hidden states, max |Δ| ≤ 1e-5 × max |reference| (the same dequantized weights: measured
0 for fp8, 2e-7 for int8); mlx-lm vs clef-local on the int4 variant the same (measured 3e-7).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_local
from clef_local.export.quantize import quantize_release
from clef_local.formats.manifest import MANIFEST, file_entries
from clef_local.formats.safetensors import read_header
from clef_local.formats.variant import variant_format

RELATIVE = 1e-5
IDS = torch.tensor(np.random.default_rng(0).integers(3, 200, (2, 12)))
MASK = torch.ones_like(IDS)


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, tiny_qwen: Path, tiny_llama: Path
             ) -> dict[tuple[str, str], Path]:
    """{(backbone, scheme): variant}: tiny Qwen3.5's fp8 / int8 / int4, tiny llama's int4."""
    root = tmp_path_factory.mktemp("eco")
    out = {}
    for kind, source, scheme in (("qwen3_5", tiny_qwen, "fp8"), ("qwen3_5", tiny_qwen, "int8"),
                                 ("qwen3_5", tiny_qwen, "int4"), ("llama", tiny_llama, "int4")):
        out[(kind, scheme)] = root / f"{kind}-{scheme}"
        quantize_release(source, out[(kind, scheme)], scheme, validate=False, log_summary=False)
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _ours(path: Path) -> np.ndarray:
    return clef_local.load(path, dtype="float32").backend.backbone.forward(IDS, MASK).float().numpy()


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_compressed_tensors_parses_the_config_and_ignore_is_exactly_the_unquantized_linears(variants, scheme):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    path = variants[("qwen3_5", scheme)]
    qconfig = _config(path)["quantization_config"]
    parsed = QuantizationConfig.model_validate({k: v for k, v in qconfig.items() if k != "clef_local"})
    (group,) = parsed.config_groups.values()
    assert parsed.format == {"fp8": "float-quantized", "int8": "int-quantized"}[scheme]
    assert (group.weights.num_bits, group.weights.type, group.weights.strategy, group.weights.symmetric) == (
        8, {"fp8": "float", "int8": "int"}[scheme], QuantizationStrategy.CHANNEL, True)
    activations = group.input_activations
    assert (activations.strategy, activations.dynamic, activations.type) == (
        QuantizationStrategy.TOKEN, True, group.weights.type)
    headers = read_header(path / "model.safetensors").tensors
    quantized = {n.removesuffix(".weight_scale") for n in headers if n.endswith(".weight_scale")}
    assert quantized and not quantized & set(parsed.ignore)
    # every linear of the architecture is quantized or ignored: lm_head and the vision tower among the ignored
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.AutoConfig.from_pretrained(path))
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(parsed.ignore) | quantized == linear
    assert "lm_head" in parsed.ignore and any(n.startswith("model.visual.") for n in parsed.ignore)
    assert variant_format(_config(path)).label == (f"{scheme} (compressed-tensors {parsed.format}, written by "
                                                   f"clef-local)")


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_transformers_loads_the_backbone_and_its_hidden_states_match(variants, scheme):
    import transformers

    path = variants[("qwen3_5", scheme)]
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    with torch.inference_mode():
        reference = model.model.language_model(input_ids=IDS, attention_mask=MASK).last_hidden_state.numpy()
    ours = _ours(path)
    assert np.abs(ours - reference).max() <= RELATIVE * np.abs(reference).max()


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_mlx_lm_reads_the_int4_variant(variants, kind):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model

    path = variants[(kind, "int4")]
    config = _config(path)
    assert config["quantization"] == {"group_size": config["quantization_config"]["group_size"], "bits": 4,
                                      "mode": "affine"}
    model, _ = load_model(path)
    model.set_dtype(mx.float32)  # the bf16 scales widen exactly; clef-local runs float32 too
    inner = getattr(model, "language_model", model)
    reference = np.array(inner.model(mx.array(IDS.numpy())).astype(mx.float32))
    ours = _ours(path)
    assert np.abs(ours - reference).max() <= RELATIVE * np.abs(reference).max()


LEGACY = {
    "fp8": {"quant_method": "clef-local", "scheme": "fp8", "bits": 8, "fmt": "float8_e4m3fn",
            "granularity": "per_output_channel", "weight_dtype": "float8_e4m3fn", "scale_dtype": "float32",
            "activation_scheme": "none (weight-only)", "tensors": ["weight", "weight_scale"]},
    "int8": {"quant_method": "clef-local", "scheme": "int8", "bits": 8, "symmetric": True,
             "granularity": "per_output_channel", "weight_dtype": "int8", "scale_dtype": "float32",
             "tensors": ["weight", "weight_scale"]},
    "int4": {"quant_method": "clef-local", "scheme": "int4", "group_size": None, "bits": 4, "mode": "affine",
             "layout": "mlx", "grid": "mse"},
}


@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_variants_written_before_the_standard_configs_still_load(variants, tmp_path, scheme):
    """The config of a variant written before this change (``quant_method: clef-local``, no ``quantization``
    block) on the same tensors: the same scheme and the same hidden states, bit for bit."""
    path = variants[("qwen3_5", scheme)]
    old = tmp_path / "old"
    shutil.copytree(path, old)
    config = _config(path)
    config.pop("quantization", None)
    member = config["quantization_config"]["clef_local"]
    legacy = {**LEGACY[scheme], **({"group_size": member["group_size"]} if scheme == "int4" else {})}
    config["quantization_config"] = {**legacy, "clef_local": member}
    (old / "config.json").write_text(json.dumps(config))
    manifest = json.loads((old / MANIFEST).read_text())  # an old variant's manifest recorded its own config.json
    manifest["files"].update(file_entries(old, ["config.json"]))
    (old / MANIFEST).write_text(json.dumps(manifest))
    fmt = variant_format(config)
    assert (fmt.scheme, fmt.writer) == (scheme, "clef-local")
    np.testing.assert_array_equal(_ours(old), _ours(path))


def test_variant_format_reads_the_ecosystems_configs_and_names_what_it_does_not():
    from clef_local.errors import ReleaseError
    from clef_local.quant import compressed

    assert variant_format({}) is None
    assert variant_format({"quantization": {"group_size": 32, "bits": 4, "mode": "affine"}}).label == (
        "int4 g32 (mlx affine, written by mlx-lm)")
    ct = compressed.quantization_config("int8", ["lm_head"])
    assert variant_format({"quantization_config": ct}).label == "int8 (compressed-tensors int-quantized, written by " \
                                                                "compressed-tensors)"
    assert variant_format({"quantization_config": {"quant_method": "bitsandbytes", "bnb_4bit_quant_type": "nf4"}
                           }).writer == "bitsandbytes"
    with pytest.raises(ReleaseError, match=r"mlx-lm quantization .* 4-bit affine"):
        variant_format({"quantization": {"group_size": 64, "bits": 8}})
    with pytest.raises(ReleaseError, match=r"no per-layer entries \(found model.layers.0.mlp\)"):
        variant_format({"quantization": {"group_size": 64, "bits": 4, "model.layers.0.mlp": {"bits": 8}}})
    with pytest.raises(ReleaseError, match="format 'nvfp4-pack-quantized' is not one clef-local reads"):
        variant_format({"quantization_config": {**ct, "format": "nvfp4-pack-quantized"}})
    packed = compressed.quantization_config("int4", ["lm_head"], group_size=64)
    assert variant_format({"quantization_config": packed}).label == (
        "int4 g64 (compressed-tensors pack-quantized, written by compressed-tensors)")
    with pytest.raises(ReleaseError, match=r"pack-quantized weights .* group_size 32/64/128 and no actorder"):
        variant_format({"quantization_config": {**ct, "format": "pack-quantized"}})  # 8-bit per channel
    group = ct["config_groups"]["group_0"]
    grouped = {**ct, "config_groups": {"group_0": {**group, "weights": {**group["weights"], "strategy": "group"}}}}
    with pytest.raises(ReleaseError, match=r"weights .* clef-local reads"):
        variant_format({"quantization_config": grouped})
    with pytest.raises(ReleaseError, match="quant_method 'gptq' is not a format clef-local reads"):
        variant_format({"quantization_config": {"quant_method": "gptq"}})
    mislabelled = {**ct, "clef_local": {"scheme": "fp8"}}
    with pytest.raises(ReleaseError, match="describes int8 tensors but its clef_local member says fp8"):
        variant_format({"quantization_config": mislabelled})
