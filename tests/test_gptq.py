"""GPTQ (``quant.gptq``) and ``clef-local quantize --calibrate`` (``export.calibration``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import clef_local
from clef_local import quant
from clef_local.data.datasets import banking77_rows, nlupp_rows
from clef_local.data.probes import probe_requests
from clef_local.export.gptq_calibration import _record_layer_calls, _run_layer, calibration_requests
from clef_local.export.quantize import ExportError, main, quantize_release
from clef_local.quant import gptq

CASES = [("int8", None, "mse"), ("fp8", None, "mse"), ("int4", 32, "mse"), ("int4", 64, "mse"), ("int4", 64, "mlx"),
         ("nf4", 64, "mse"), ("nf4", 256, "mse")]


def weight(rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.05
    w[3, 17] = 0.9  # an outlier, as real rows have
    return w.to(torch.bfloat16)


def correlated_hessian(cols: int = 256, seed: int = 1) -> torch.Tensor:
    """``E[x xᵀ]`` of inputs whose columns are strongly correlated (as hidden states are)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 16, generator=gen) @ torch.randn(16, cols, generator=gen)
    x += 0.1 * torch.randn(4096, cols, generator=gen)
    return x.T @ x / x.shape[0]


def rtn(scheme: str, w: torch.Tensor, group: int | None, grid: str) -> dict[str, torch.Tensor]:
    options = {"grid": grid} if scheme == "int4" else {}
    return quant.get(scheme).quantize(w, group, **options)


def dequantized(scheme: str, packed: dict[str, torch.Tensor], group: int | None) -> torch.Tensor:
    return quant.get(scheme).dequantize(packed, group, torch.float32)


@pytest.mark.parametrize(("scheme", "group", "grid"), CASES)
def test_identity_hessian_is_round_to_nearest_bit_for_bit(scheme: str, group: int | None, grid: str) -> None:
    w = weight()
    ours = gptq.quantize(w, torch.eye(w.shape[1]), scheme, group, grid=grid)
    theirs = rtn(scheme, w, group, grid)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype and ours[key].shape == theirs[key].shape, key
        assert torch.equal(ours[key].view(torch.uint8), theirs[key].view(torch.uint8)), key


@pytest.mark.parametrize(("scheme", "group", "grid"), CASES)
def test_gptq_cuts_the_output_error_and_keeps_the_layout(scheme: str, group: int | None, grid: str) -> None:
    w, h = weight(), correlated_hessian()
    ours = gptq.quantize(w, h, scheme, group, grid=grid)
    theirs = rtn(scheme, w, group, grid)
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    error = gptq.output_error(w, dequantized(scheme, ours, group), h)
    baseline = gptq.output_error(w, dequantized(scheme, theirs, group), h)
    assert error < 0.6 * baseline, (error, baseline)
    if scheme == "int4":  # codes stay on the 16-level grid the scales describe
        assert int(quant.int4.unpack(ours["weight"]).max()) <= 15
    if scheme == "nf4":
        assert quant.nf4.read_quant_state(ours) == quant.nf4.read_quant_state(theirs)


def test_dead_input_columns_quantize_to_zero() -> None:
    w, h = weight(), correlated_hessian()
    h[5, :] = 0
    h[:, 5] = 0
    packed = gptq.quantize(w, h, "int8")
    assert torch.all(packed["weight"][:, 5] == 0)
    assert torch.isfinite(dequantized("int8", packed, None)).all()


def test_bad_inputs_are_named() -> None:
    w = weight()
    with pytest.raises(ValueError, match="not 'mxfp4'"):
        gptq.quantize(w, torch.eye(256), "mxfp4")
    with pytest.raises(ValueError, match="multiple of the block size 64"):
        gptq.quantize(weight(cols=96), torch.eye(96), "nf4")
    with pytest.raises(ValueError, match="does not match the weight's 256 input columns"):
        gptq.quantize(w, torch.eye(128), "int8")
    with pytest.raises(ValueError, match="not positive definite"):
        gptq.quantize(w, torch.full((256, 256), float("nan")), "int8")
    with pytest.raises(ValueError, match="damp must be in"):
        gptq.inverse_factor(torch.eye(4), damp=1.5)


def test_calibration_requests_come_from_the_training_splits_only() -> None:
    requests = calibration_requests(64)
    states = {r["state"] for r in requests}
    held_out = {text for text, _ in banking77_rows("test")} | {text for text, _ in nlupp_rows(range(16, 20))}
    assert len(requests) == 64 and not states & held_out
    assert not states & {r["state"] for r in probe_requests(64)}  # never the validation probes
    assert calibration_requests(64) == requests  # fixed seed


@pytest.mark.parametrize("backbone", ["llama", "qwen3_5"])
def test_recorded_layer_calls_replay_the_forward_pass(backbone: str, tiny_llama: Path, tiny_qwen: Path) -> None:
    """Replaying the decoder layers one by one on the recorded calls gives the backbone's own final states."""
    model = clef_local.load(tiny_llama if backbone == "llama" else tiny_qwen, backend="torch", dtype="float32")
    bb = model.backend.backbone
    ids = [torch.tensor([model.encode(r).input_ids]) for r in calibration_requests(3)]
    hidden, calls = _record_layer_calls(bb.text_model, bb.text_model.layers, ids)
    for index, layer in enumerate(bb.text_model.layers):
        hidden = _run_layer(layer, hidden, [c[index] for c in calls])
    for states, x in zip(hidden, ids, strict=True):
        expected = bb.forward(x, torch.ones_like(x))
        torch.testing.assert_close(bb.text_model.norm(states), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def calibrated(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("gptq")
    summary = quantize_release(tiny_llama, root / "gptq", "int8", calibrate=True, calibration_requests=8,
                               validate=False)
    quantize_release(tiny_llama, root / "rtn", "int8", validate=False)
    return root / "gptq", root / "rtn", summary


def test_calibrated_export_writes_gptq_tensors_in_the_scheme_layout(calibrated: tuple[Path, Path, dict]) -> None:
    out, baseline, summary = calibrated
    cal = json.loads((out / "config.json").read_text())["quantization_config"]["clef_local"]["calibration"]
    assert cal["method"] == "gptq" and cal["requests"] == 8 and cal == summary["calibration"]
    assert cal["dtype"] == "float32"  # a tiny release fits in float32
    assert 0 < cal["output_error_ratio"] < 1
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(baseline / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    differ = [k for k in ours if k.endswith(".weight") and ours[k].dtype == torch.int8
              and not torch.equal(ours[k], theirs[k])]
    assert differ  # GPTQ moved codes; everything unquantized is the same bytes
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if ours[k].is_floating_point()
               and not k.endswith("weight_scale"))
    answer = clef_local.load(out).decide(probe_requests(1)[0])
    assert answer["answers"]


def test_calibrated_int4_stores_scales_in_the_source_dtype(tiny_llama: Path, tmp_path: Path) -> None:
    """Calibration computes in float32, but the variant's tensors are stored exactly as round-to-nearest's are."""
    summary = quantize_release(tiny_llama, tmp_path / "gptq", "int4", 32, calibrate=True, calibration_requests=4,
                               validate=False)
    quantize_release(tiny_llama, tmp_path / "rtn", "int4", 32, validate=False)
    assert summary["calibration"]["dtype"] == "float32"
    ours = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "rtn" / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    assert any(k.endswith(".scales") and v.dtype == torch.bfloat16 for k, v in ours.items())


def test_calibrate_refusals_leave_nothing(tiny_llama: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match="applies with --calibrate only"):
        quantize_release(tiny_llama, tmp_path / "v", "int8", calibration_requests=4)
    (tmp_path / "taken").mkdir()
    assert main(["--model", str(tiny_llama), "--bits", "8", "--calibrate", "--out", str(tmp_path / "taken")]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("scheme", "group", "grid"), CASES)
def test_gptq_on_cuda_matches_the_cpu(scheme: str, group: int | None, grid: str) -> None:
    """The same weight and Hessian on the GPU: the same layout, output error within 1% of the CPU's (the Cholesky
    factors round differently, so codes near a rounding boundary may differ)."""
    w, h = weight(), correlated_hessian()
    cpu = gptq.quantize(w, h, scheme, group, grid=grid)
    gpu = gptq.quantize(w.cuda(), h.cuda(), scheme, group, grid=grid)
    assert {k: (v.dtype, v.shape) for k, v in gpu.items()} == {k: (v.dtype, v.shape) for k, v in cpu.items()}
    errors = [gptq.output_error(w, dequantized(scheme, {k: v.cpu() for k, v in p.items()}, group), h)
              for p in (cpu, gpu)]
    assert errors[1] == pytest.approx(errors[0], rel=0.01)
