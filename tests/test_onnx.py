"""ONNX export and the ONNX Runtime backend: MatMulNBits layouts, parity with the torch backend, dynamic batch,
torch-free decisions, atomic export.

Tolerances (the export's own, :data:`clef_local.export.onnx.validate.TOLERANCES`): hidden states max |Δh| ≤ 1e-4
relative to max |h|, probabilities max |Δp| ≤ 1e-3, no flipped decision on these probes, for fp32, int8 and int4
(the same weights in float32 arithmetic: only kernel noise differs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

PROBES = 4


class Exports:
    """ONNX releases of the tiny releases, exported on first use (int8/int4 quantized first, like the CLI); only
    the fp32/fp16 exports run the export's own validation (the parity tests below measure the rest)."""

    def __init__(self, request: pytest.FixtureRequest, root: Path) -> None:
        self.request, self.root, self.done = request, root, {}

    def __call__(self, backbone: str, fmt: str) -> Path:
        from clef_local.export.onnx.export import export_onnx

        if (backbone, fmt) not in self.done:
            source = self.request.getfixturevalue("tiny_qwen" if backbone == "qwen3_5" else "tiny_llama")
            summary = export_onnx(source, self.root / f"{backbone}-{fmt}", fmt, validate=fmt in ("fp32", "fp16"),
                                  probes=PROBES)
            self.done[(backbone, fmt)] = Path(summary["out"])
        return self.done[(backbone, fmt)]


@pytest.fixture(scope="session")
def exports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Exports:
    return Exports(request, tmp_path_factory.mktemp("onnx"))


def _run_nbits(spec, a: np.ndarray) -> np.ndarray:
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(spec.packed, "B"), numpy_helper.from_array(spec.scales, "S")]
    names = ["A", "B", "S"]
    if spec.zero_points is not None:
        inits.append(numpy_helper.from_array(spec.zero_points, "Z"))
        names.append("Z")
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=spec.k, N=spec.n, bits=spec.bits,
                            block_size=spec.block_size)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, spec.k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, spec.n])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_matmulnbits_uses_the_variant_codes(group: int) -> None:
    """MatMulNBits built from quant.int4's tensors computes x @ dequantize(W).T, and B is the packed words' bytes."""
    import torch

    from clef_local.export.onnx.graph import int4_nbits
    from clef_local.quant import int4

    torch.manual_seed(0)
    weight = torch.randn(48, 256, dtype=torch.float32).to(torch.bfloat16)
    packed = int4.quantize(weight, group)
    words = packed["weight"].view(torch.int32).numpy().view(np.uint32)
    spec = int4_nbits(words, packed["scales"].float().numpy(), packed["biases"].float().numpy(), group)
    assert spec.block_size == group and spec.bits == 4
    assert spec.packed.tobytes() == words.astype("<u4").tobytes()  # the same 4-bit codes, byte for byte
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    reference = x @ int4.dequantize(packed, group, torch.float32).numpy().T
    out = _run_nbits(spec, x)
    assert np.abs(out - reference).max() <= 1e-5 * np.abs(reference).max()


@pytest.mark.parametrize("k", [256, 576, 100])
def test_int8_matmulnbits_uses_the_variant_codes(k: int) -> None:
    import torch

    from clef_local.export.onnx.graph import int8_nbits
    from clef_local.quant import int8

    torch.manual_seed(1)
    packed = int8.quantize(torch.randn(40, k))
    spec = int8_nbits(packed["weight"].numpy(), packed["weight_scale"].numpy())
    assert spec.bits == 8 and spec.zero_points is None
    codes = spec.packed.reshape(40, -1)[:, :k].astype(np.int16) - 128
    np.testing.assert_array_equal(codes, packed["weight"].numpy())
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    reference = x @ int8.dequantize(packed).numpy().T
    assert np.abs(_run_nbits(spec, x) - reference).max() <= 1e-5 * np.abs(reference).max()


def test_numpy_head_loads_strictly(tiny_llama: Path, tmp_path: Path) -> None:
    """An extra or mis-shaped head tensor is named, as the torch head's strict load does."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from clef_local.errors import ReleaseError
    from clef_local.formats.release import read_release
    from clef_local.heads.numpy_head import load_head

    copy = shutil.copytree(tiny_llama, tmp_path / "release")
    state = load_file(str(copy / "joint_head.safetensors"))
    state["stray.weight"] = np.zeros(3, dtype=np.float32)
    state["type_embedding.weight"] = state["type_embedding.weight"][:2]
    save_file(state, str(copy / "joint_head.safetensors"))
    with pytest.raises(ReleaseError, match=r"unexpected tensors: stray\.weight.*mis-shaped tensors: type_embedding"):
        load_head(read_release(copy))


@pytest.mark.parametrize("backbone,fmt", [
    ("qwen3_5", "fp32"), ("qwen3_5", "int8"), ("qwen3_5", "int4"), ("llama", "fp32"),
    pytest.param("llama", "int8", marks=pytest.mark.slow), pytest.param("llama", "int4", marks=pytest.mark.slow),
    pytest.param("llama", "fp16", marks=pytest.mark.slow)])
def test_parity_with_torch_backend(exports: Exports, backbone: str, fmt: str) -> None:
    """fp32/int8/int4: rel |Δh| ≤ 1e-4, |Δp| ≤ 1e-3; fp16 (on the CPU provider here): 1e-2 and 2e-2."""
    from clef_local.data.probes import probe_requests
    from clef_local.export.onnx.validate import TOLERANCES, run_parity

    out = exports(backbone, fmt)
    result = run_parity(out, probe_requests(PROBES, seed=3))
    tolerance = TOLERANCES[fmt]
    assert result["hidden_rel"] <= tolerance["hidden_rel"]
    assert result["max_abs_dp"] <= tolerance["max_abs_dp"]
    assert result["flips"] == 0
    assert result["batch_rel"] <= tolerance["batch_rel"]


@pytest.mark.parametrize("fmt,bits", [("int8", 8), ("int4", 4)])
def test_quantized_graph_has_matmulnbits_from_the_variant(exports: Exports, fmt: str, bits: int) -> None:
    import onnx

    out = exports("qwen3_5", fmt)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["clef_local"]["scheme"] == fmt  # the directory is the variant itself
    model = onnx.load(str(out / "onnx" / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == quant["clef_local"]["quantized"] > 0  # every quantized linear, none re-quantized
    assert {a.i for n in nodes for a in n.attribute if a.name == "bits"} == {bits}
    if fmt == "int4":
        assert {a.i for n in nodes for a in n.attribute if a.name == "block_size"} == {quant["group_size"]}
    # Qwen3.5's 3 linear-attention layers run as GatedDeltaNet (tiny config: 3 of 4 layers)
    assert sum(n.op_type == "GatedDeltaNet" for n in model.graph.node) == 3


def test_validation_report_of_the_export(exports: Exports) -> None:
    validation = json.loads((exports("qwen3_5", "fp32") / "onnx" / "validation.json").read_text())
    assert validation["passed"] and validation["requests"] == PROBES
    assert {(r["output"], r["metric"]) for r in validation["checks"]} >= {
        ("last_hidden_state", "hidden_rel"), ("probabilities", "max_abs_dp"), ("batch 1 vs 3", "batch_rel")}


def test_release_layout_and_manifest(exports: Exports, tiny_llama: Path) -> None:
    from clef_local.formats.manifest import verify

    out = exports("llama", "fp32")
    for name in ("joint_head.safetensors", "joint_head_config.json", "tokenizer.json", "config.json",
                 "model.safetensors"):
        assert (out / name).read_bytes() == (tiny_llama / name).read_bytes()
    assert verify(out) == []
    manifest = json.loads((out / "clef_local_manifest.json").read_text())
    assert "onnx/model.onnx" in manifest["files"] and "onnx/model.onnx.data" in manifest["files"]
    embedding = np.load(out / "onnx" / "output_embedding.npy")
    assert embedding.dtype == np.uint16  # BF16 release: the bit patterns, widened exactly at read time


@pytest.mark.parametrize("backbone", ["qwen3_5", "llama"])
def test_batch_axis_is_dynamic(exports: Exports, backbone: str) -> None:
    session = ort.InferenceSession(str(exports(backbone, "fp32") / "onnx" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, size=(3, 41), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 25:] = 0
    mask[2, 9:] = 0
    together = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    for row, length in ((0, 41), (1, 25), (2, 9)):
        alone = session.run(None, {"input_ids": ids[row : row + 1, :length],
                                   "attention_mask": mask[row : row + 1, :length]})[0]
        assert alone.shape == (1, length, together.shape[-1])
        np.testing.assert_allclose(alone[0], together[row, :length], atol=1e-5, rtol=1e-5)


def test_decision_without_torch(exports: Exports) -> None:
    script = (
        "import sys, json\n"
        "sys.modules['torch'] = None\n"
        "import clef_local\n"
        f"model = clef_local.load({str(exports('qwen3_5', 'int4'))!r}, backend='onnx')\n"
        "answer = model.decide({'model': 'x', 'state': 'my card was stolen', 'questions': {'q': {'type': 'choice', "
        "'criteria': {'lost': 'card lost', 'other': None}}}})\n"
        "assert sys.modules['torch'] is None, 'torch was imported'\n"
        "assert not any(m.startswith('torch.') for m in sys.modules), 'a torch submodule was imported'\n"
        "print(json.dumps(answer))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    probabilities = answer["answers"]["q"]["probabilities"]
    assert set(probabilities) == {"lost", "other"} and abs(sum(probabilities.values()) - 1) < 1e-5


def test_unavailable_provider_names_the_available_ones(exports: Exports) -> None:
    from clef_local.backends.onnx_backend import OnnxBackend, OnnxProviderError, providers_for
    from clef_local.formats.release import read_release

    with pytest.raises(OnnxProviderError, match=r"CUDAExecutionProvider is not available.*CPUExecutionProvider"):
        providers_for("cuda", ["CPUExecutionProvider"])
    with pytest.raises(OnnxProviderError, match="cpu or cuda, not 'mps'"):
        providers_for("mps", ["CPUExecutionProvider"])
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(OnnxProviderError, match=r"available providers: .*CPUExecutionProvider"):
            OnnxBackend(read_release(exports("llama", "fp32")), device="cuda", dtype=None)


@pytest.mark.cuda
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu and a CUDA GPU")
def test_cuda_provider_matches_cpu(exports: Exports) -> None:
    """benchmarks/gpu_check.sh runs this (pytest -m cuda) where onnxruntime-gpu is installed."""
    import clef_local
    from clef_local.backends.onnx_backend import OnnxBackend
    from clef_local.data.probes import probe_requests
    from clef_local.export.validate import compare

    requests = probe_requests(PROBES, seed=5)
    for fmt in ("fp32", "int4", "int8"):
        model = clef_local.load(exports("qwen3_5", fmt), backend="onnx")
        cpu = [p.probabilities for p in model.predict(requests)]
        model.backend = OnnxBackend(model.release, device="cuda", dtype=None)
        assert model.backend.session.get_providers()[0] == "CUDAExecutionProvider"
        cuda = [p.probabilities for p in model.predict(requests)]
        assert compare(cpu, cuda)["max_abs_dp"] <= 1e-3, fmt


def test_refuses_existing_out_without_force(exports: Exports, tiny_llama: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from clef_local.export.onnx.export import main

    out = exports("llama", "fp32")
    before = sorted(p.name for p in out.iterdir())
    assert main(["--model", str(tiny_llama), "--out", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


def test_failed_validation_leaves_nothing(exports: Exports, tiny_llama: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A tolerance exceeded: exit 1, no output directory, no temporary sibling (the graph is reused, not retraced)."""
    import shutil

    from clef_local.export.onnx import export as onnx_export
    from clef_local.export.onnx import validate as onnx_validate

    done = exports("llama", "fp32")
    config = json.loads((done / "onnx" / "onnx_config.json").read_text())

    def reuse_graph(tmp: Path, fmt: str) -> dict:
        shutil.copytree(done / "onnx", tmp / "onnx")
        return config

    monkeypatch.setattr(onnx_export, "_write_onnx", reuse_graph)
    monkeypatch.setitem(onnx_validate.TOLERANCES, "fp32", {"hidden_rel": -1.0, "max_abs_dp": 1e-3, "batch_rel": 1e-4})
    out = tmp_path / "never"
    assert onnx_export.main(["--model", str(tiny_llama), "--out", str(out), "--probes", "2"]) == 1
    assert "fails validation" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary sibling


@pytest.mark.slow
def test_demo_model_onnx_parity(demo_release: Path, tmp_path: Path) -> None:
    """The demo model (SmolLM2-135M, BF16) quantized to int4 and exported (``MatMulNBits`` from its own codes): ONNX
    vs torch float32, a few probes. int4 at full size covers the export, the quantized graph and the numpy head; the
    fp32 graph is the same export without the NBits rewrite (tiny releases above; benchmarks/onnx_backend.py
    measures it on the demo model)."""
    from clef_local.export.onnx.export import export_onnx

    summary = export_onnx(demo_release, tmp_path / "demo-onnx", "int4", probes=4)
    validation = summary["validation"]
    assert validation["passed"], validation["failed"]
    assert validation["hidden_rel"] <= 1e-4 and validation["max_abs_dp"] <= 1e-3


def test_export_onnx_without_a_probe_set_is_refused_before_writing(tiny_llama: Path, tmp_path: Path, monkeypatch,
                                                                   capsys) -> None:
    """Before, the ONNX validation was skipped with a warning and the export exited 0."""
    from clef_local.export.onnx import export as onnx_export

    def no_data(*args, **kwargs):
        raise FileNotFoundError("banking77/test.csv is missing")

    monkeypatch.setattr("clef_local.data.probes.probe_requests", no_data)
    out = tmp_path / "onnx"
    assert onnx_export.main(["--model", str(tiny_llama), "--out", str(out), "--format", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: validation cannot run: the packaged probe set cannot be read (banking77/test.csv is "
                          "missing)") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
