"""int4 in compressed-tensors' pack-quantized layout (``--int4-layout compressed``): the tensors are bit for bit what
compressed-tensors' ``PackedQuantizationCompressor`` writes and reads, its config model parses the config,
transformers loads the variant, clef-local's backends (torch resident / streamed / bf16 kernel, MLX) run it, the
planner counts it, and checkpoints written by compressed-tensors itself (asymmetric and symmetric) load.

Tolerances: compressed-tensors and transformers dequantize ``scale · (q - zero)`` in the scale's dtype (bf16),
clef-local in float32 (exact), so the weights agree after a bf16 rounding (asserted exactly) and the last hidden
states to max |Δ| ≤ 5e-3 × max |reference| (measured 1.4e-3 on tiny Qwen3.5). The same grid in the two layouts:
the mlx grid stores the same codes and scales, the bias exact here and rounded to bf16 there: probabilities within
1e-3 (measured 1.5e-4); the mse grid restricted to integer zero points is another grid: within 2e-2 (measured 8.5e-3,
about the distance of either from the release).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import clef_local
from clef_local.backends.quantized import PackedInt4Linear
from clef_local.errors import ClefError
from clef_local.export.quantize import quantize_release
from clef_local.formats.safetensors import read_header
from clef_local.formats.variant import variant_format
from clef_local.quant import int4, int4_packed

ct = pytest.importorskip("compressed_tensors")

IDS = torch.tensor(np.random.default_rng(0).integers(3, 200, (2, 12)))
MASK = torch.ones_like(IDS)
RELATIVE = 5e-3


def _scheme(group: int, symmetric: bool = False):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric, dynamic=False))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _hidden(path: Path, **kwargs) -> np.ndarray:
    return clef_local.load(path, dtype="float32", **kwargs).backend.backbone.forward(IDS, MASK).float().numpy()


def _probabilities(model) -> np.ndarray:
    from clef_local.data.probes import probe_requests

    return np.concatenate([p.ravel() for r in model.predict(probe_requests(4, seed=7)) for p in r.probabilities])


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, tiny_qwen: Path, tiny_llama: Path) -> dict[str, Path]:
    """Tiny Qwen3.5 in both layouts on both grids; tiny llama packed (group 32)."""
    root = tmp_path_factory.mktemp("packed")
    out = {}
    for layout in ("compressed", "mlx"):
        for grid in ("mse", "mlx"):
            out[f"qwen-{layout}-{grid}"] = root / f"qwen-{layout}-{grid}"
            quantize_release(tiny_qwen, out[f"qwen-{layout}-{grid}"], "int4", validate=False, log_summary=False,
                             int4_grid=grid, int4_layout=layout)
    out["llama-compressed"] = root / "llama-compressed"
    quantize_release(tiny_llama, out["llama-compressed"], "int4", 32, validate=False, log_summary=False,
                     int4_layout="compressed")
    return out


@pytest.mark.parametrize("grid", ["mse", "mlx"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_tensors_are_what_compressed_tensors_compresses_and_decompresses(grid: str, group: int) -> None:
    from compressed_tensors.compressors import PackedQuantizationCompressor

    weight = (torch.randn(44, 256, generator=torch.Generator().manual_seed(group)) * torch.linspace(0.2, 3, 44)[:, None]
              ).bfloat16()  # 44 rows: a partial zero-point word
    weight[3] = weight[3].abs() + 1  # a row all positive, far from 0: its zero point is a code all the same
    ours = int4_packed.quantize(weight, group, grid)
    zero = int4_packed.unpack_columns(ours["weight_zero_point"], 44)
    assert int(zero.min()) >= 0 and int(zero.max()) <= 15 and bool((ours["weight_scale"] > 0).all())
    assert ours["weight_packed"].dtype == torch.int32 and ours["weight_zero_point"].shape == (6, 256 // group)
    assert ours["weight_shape"].tolist() == [44, 256] and ours["weight_shape"].dtype == torch.int64
    dequantized = int4_packed.dequantize(ours, group, torch.float32)

    # compressed-tensors' compressor, given our scale and zero point (its codes are signed: zero - 8), on weights
    # that lie on the grid, writes the same tensors bit for bit
    state = {"weight": dequantized, "weight_scale": ours["weight_scale"].float(),
             "weight_zero_point": (zero - 8).to(torch.int8)}
    theirs = PackedQuantizationCompressor.compress(state, _scheme(group))
    for key in ("weight_packed", "weight_zero_point", "weight_shape"):
        assert theirs[key].dtype == ours[key].dtype and torch.equal(theirs[key], ours[key]), key
    back = PackedQuantizationCompressor.decompress(dict(ours), _scheme(group))
    assert back["weight"].dtype == torch.bfloat16  # it dequantizes in the scale's dtype; clef-local in float32
    torch.testing.assert_close(back["weight"], dequantized.bfloat16(), rtol=0, atol=0)
    assert float((dequantized - weight.float()).abs().max()) < float(weight.float().abs().max()) / 8


def test_the_mlx_grid_keeps_mlx_codes_and_the_mse_grid_is_never_worse() -> None:
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    q_mlx, scale, _ = int4.quantize_values(weight, 64, "mlx")
    packed = int4_packed.quantize(weight, 64, "mlx")
    codes = int4.unpack(packed["weight_packed"])
    flipped = (scale < 0).repeat_interleave(64, dim=1)
    assert torch.equal(codes, torch.where(flipped, 15 - q_mlx, q_mlx))  # negative scales flip to 15 - q
    torch.testing.assert_close(packed["weight_scale"], scale.abs())
    mlx_affine = int4.dequantize(int4.quantize(weight, 64, "mlx"), 64, torch.float32)
    mlx_packed = int4_packed.dequantize(packed, 64, torch.float32)
    assert float((mlx_packed - mlx_affine).abs().max()) <= 2 ** -7 * float(weight.float().abs().max())  # bf16 bias

    def error(grid: str) -> float:
        back = int4_packed.dequantize(int4_packed.quantize(weight, 64, grid), 64, torch.float32)
        return float((back - weight.float()).square().sum())

    assert error("mse") < 0.95 * error("mlx")  # measured 0.92


def test_the_config_is_compressed_tensors_own_and_ignores_exactly_the_unquantized_linears(variants) -> None:
    import transformers
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    path = variants["qwen-compressed-mse"]
    config = _config(path)
    assert "quantization" not in config  # mlx-lm's block would make mlx-lm misread the tensors
    qconfig = config["quantization_config"]
    assert qconfig["clef_local"]["layout"] == "compressed" and qconfig["clef_local"]["grid"] == "mse"
    # without --int4-grid the compressed layout takes the mlx grid (it drifted less on the demo model)
    assert _config(variants["llama-compressed"])["quantization_config"]["clef_local"]["grid"] == "mlx"
    parsed = QuantizationConfig.model_validate({k: v for k, v in qconfig.items() if k != "clef_local"})
    (group,) = parsed.config_groups.values()
    weights = group.weights
    assert parsed.format == "pack-quantized" and group.input_activations is None
    assert (weights.num_bits, weights.type, weights.strategy, weights.symmetric, weights.group_size,
            weights.dynamic) == (4, "int", QuantizationStrategy.GROUP, False, 64, False)
    headers = read_header(path / "model.safetensors").tensors
    quantized = {n.removesuffix(".weight_packed") for n in headers if n.endswith(".weight_packed")}
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(transformers.AutoConfig.from_pretrained(path))
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert quantized and not quantized & set(parsed.ignore) and set(parsed.ignore) | quantized == linear
    assert variant_format(config).label == "int4 g64 (compressed-tensors pack-quantized, written by clef-local)"
    manifest = json.loads((path / "clef_local_manifest.json").read_text())
    assert manifest["scheme"]["bits_per_weight"] == pytest.approx(
        int4_packed.bits_per_weight(64) + 16 * 8 / (64 * 2048), abs=0.2)  # + zero-word padding, weight_shape


@pytest.mark.parametrize("name", ["qwen-compressed-mse", "llama-compressed"])
def test_transformers_loads_it_and_its_hidden_states_match(variants, name: str) -> None:
    import transformers

    path = variants[name]
    cls = transformers.AutoModelForCausalLM if name.startswith("llama") else \
        transformers.Qwen3_5ForConditionalGeneration
    theirs = cls.from_pretrained(path, dtype=torch.float32,
                                 quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    model = clef_local.load(path, dtype="float32")
    prefix = "model.layers.0.mlp.down_proj" if name.startswith("llama") else \
        "model.language_model.layers.0.mlp.down_proj"
    layer = model.backend.backbone.text_model.get_submodule("layers.0.mlp.down_proj")
    assert isinstance(layer, PackedInt4Linear)
    torch.testing.assert_close(theirs.get_submodule(prefix).weight,
                               layer.dequantize(torch.float32).bfloat16().float(), rtol=0, atol=0)
    inner = theirs.model if name.startswith("llama") else theirs.model.language_model
    with torch.inference_mode():
        reference = inner(input_ids=IDS, attention_mask=MASK).last_hidden_state.numpy()
    ours = model.backend.backbone.forward(IDS, MASK).float().numpy()
    assert np.abs(ours - reference).max() <= RELATIVE * np.abs(reference).max()


@pytest.mark.parametrize(("grid", "tolerance"), [("mlx", 1e-3), ("mse", 2e-2)])
def test_the_packed_layout_answers_like_the_affine_layout_of_the_same_grid(variants, grid: str,
                                                                           tolerance: float) -> None:
    packed = _probabilities(clef_local.load(variants[f"qwen-compressed-{grid}"], dtype="float32"))
    affine = _probabilities(clef_local.load(variants[f"qwen-mlx-{grid}"], dtype="float32"))
    assert 0 < np.abs(packed - affine).max() <= tolerance


def test_streamed_bf16_kernel_and_mlx_backends_agree(variants) -> None:
    path = variants["llama-compressed"]
    resident = clef_local.load(path, dtype="float32", state_cache=0)
    reference = _probabilities(resident)
    streamed = clef_local.load(path, dtype="float32", offload="disk")
    assert set(streamed.describe()["kernels"]) == {"int4:dequantize"}
    assert np.abs(_probabilities(streamed) - reference).max() <= 1e-5
    bf16 = clef_local.load(path, dtype="bfloat16")
    assert set(bf16.describe()["kernels"]) == {"int4:int4pack_cpu"}  # torch's CPU int4 kernel, checked at load
    assert np.abs(_probabilities(bf16) - reference).max() <= 5e-2
    pytest.importorskip("mlx.core")
    mlx = clef_local.load(path, dtype="float32", backend="mlx")
    assert np.abs(_probabilities(mlx) - reference).max() <= 1e-4


def test_the_census_counts_the_stored_bytes(variants) -> None:
    from clef_local.formats.release import read_release
    from clef_local.planning.census import census_from_release

    path = variants["qwen-compressed-mse"]
    release = read_release(path)
    census = census_from_release(path, release.weight_files, release.config)
    headers = read_header(path / "model.safetensors").tensors
    layers = {n.removesuffix(".weight_packed") for n in headers if n.endswith(".weight_packed")}
    stored = sum(t.nbytes for n, t in headers.items() if n.rsplit(".", 1)[0] in layers)
    assert census.fmt == "int4" and census.exact and census.quantized_linears == stored > 0
    assert census.backbone == sum(t.nbytes for t in headers.values())


def test_the_layout_is_refused_where_it_does_not_apply(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ClefError, match="--int4-layout applies to int4 only, not int8"):
        quantize_release(tiny_llama, tmp_path / "a", "int8", validate=False, int4_layout="compressed")
    with pytest.raises(ClefError, match=r"--calibrate .* --int4-layout compressed"):
        quantize_release(tiny_llama, tmp_path / "b", "int4", validate=False, int4_layout="compressed",
                         calibrate=True)
    from clef_local.export.quantize import build_parser

    assert build_parser().parse_args(["--bits", "4", "--int4-layout", "compressed", "--out", "x"]).int4_layout \
        == "compressed"


def _compressed_tensors_checkpoint(source: Path, out: Path, symmetric: bool) -> Path:
    """The backbone of ``source`` quantized and saved by compressed-tensors itself (what llm-compressor does with a
    W4A16 recipe and its min-max observer), at group 32 (the tiny model's widths are 64), the head copied beside."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": _scheme(32, symmetric)},
                                                        ignore=["lm_head"]))
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            w = module.weight.data.float().reshape(module.weight.shape[0], -1, 32)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), scheme.weights)
            module.weight_scale.data.copy_(scale)
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for file in source.iterdir():
        if not (out / file.name).exists() and not file.name.startswith(("model", "clef_local_manifest")):
            shutil.copyfile(file, out / file.name)
    return out


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_checkpoint_written_by_compressed_tensors_loads(tiny_llama: Path, tmp_path: Path, symmetric: bool) -> None:
    import transformers
    from safetensors.torch import load_file

    path = _compressed_tensors_checkpoint(tiny_llama, tmp_path / "ct", symmetric)
    stored = load_file(path / "model.safetensors")
    prefix = "model.layers.0.self_attn.q_proj"
    assert (f"{prefix}.weight_zero_point" in stored) != symmetric and stored[f"{prefix}.weight_packed"].dtype == \
        torch.int32
    model = clef_local.load(path, dtype="float32")
    assert model.describe()["format"] == {"scheme": "int4", "group_size": 32,
                                          "layout": "compressed-tensors pack-quantized",
                                          "written_by": "compressed-tensors"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    layer = model.backend.backbone.text_model.get_submodule("layers.0.self_attn.q_proj")
    torch.testing.assert_close(theirs.get_submodule(prefix).weight,
                               layer.dequantize(torch.float32).bfloat16().float(), rtol=0, atol=0)
    with torch.inference_mode():
        reference = theirs.model(input_ids=IDS, attention_mask=MASK).last_hidden_state.numpy()
    ours = model.backend.backbone.forward(IDS, MASK).float().numpy()
    assert np.abs(ours - reference).max() <= RELATIVE * np.abs(reference).max()
    pytest.importorskip("mlx.core")
    mlx = clef_local.load(path, dtype="float32", backend="mlx")
    assert np.abs(_probabilities(mlx) - _probabilities(model)).max() <= 1e-4


def test_onnx_matmulnbits_takes_the_same_codes_and_integer_zero_points() -> None:
    pytest.importorskip("onnx_ir")
    from clef_local.export.onnx.graph import int4_nbits

    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    packed = int4_packed.quantize(weight, 64)
    affine = int4_packed.to_affine(packed)
    spec = int4_nbits(affine["weight"].numpy(), affine["scales"].numpy(), affine["biases"].numpy(), 64)
    assert spec.packed.tobytes() == packed["weight_packed"].numpy().tobytes()
    np.testing.assert_array_equal(spec.zero_points, int4_packed.unpack_columns(packed["weight_zero_point"], 32))
