"""The MLX backend against the torch backend on the same releases and variants.

Tolerance: float32 on both sides, max |Δp| per question ≤ 1e-4 (measured ≤ 4e-7 on the tiny releases), no decision
flip on the probe set. Skipped when ``mlx`` is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import clef_local  # noqa: E402
from clef_local.errors import ReleaseError  # noqa: E402

TOLERANCE = 1e-4
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
THREE = {"model": "clef-local", "state": "My card payment was declined twice at the supermarket today.",
         "questions": {"complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
                       "topic": {"type": "choice", "criteria": {"cards": None, "transfers": None, "account": None}},
                       "urgency": {"type": "score", "criteria": ["low", "medium", "high"]}}}


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    from clef_local.data.probes import probe_requests

    return probe_requests(4, seed=3)


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_qwen: Path):
    """{(backbone, scheme): path}: the tiny releases and their int4/int8 variants (nf4/fp8 of llama)."""
    from clef_local.export.quantize import quantize_release

    root = tmp_path_factory.mktemp("mlx-variants")
    out: dict[tuple[str, str | None], Path] = {("llama", None): tiny_llama, ("qwen3_5", None): tiny_qwen}
    for (kind, source), schemes in {("llama", tiny_llama): ("int4", "int8", "nf4", "fp8"),
                                    ("qwen3_5", tiny_qwen): ("int4", "int8")}.items():
        for scheme in schemes:
            out[(kind, scheme)] = root / f"{kind}-{scheme}"
            quantize_release(source, out[(kind, scheme)], scheme, validate=False, log_summary=False)
    return out


@pytest.fixture(scope="module")
def loaded(variants):
    """load(kind, scheme, backend): each release loaded once per module (float32, CPU)."""
    cache: dict[tuple[str, str | None, str], clef_local.ClefModel] = {}

    def load(kind: str, scheme: str | None, backend: str) -> clef_local.ClefModel:
        key = (kind, scheme, backend)
        if key not in cache:
            cache[key] = clef_local.load(variants[(kind, scheme)], backend=backend, dtype="float32", device="cpu")
        return cache[key]

    return load


def _probabilities(model: clef_local.ClefModel, requests: list[dict]) -> list[list[np.ndarray]]:
    return [p.probabilities for p in model.predict(requests, batch_size=4)]


def _compare(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> tuple[float, int]:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return (max(float(np.abs(x - y).max()) for x, y in pairs),
            sum(int(np.argmax(x) != np.argmax(y)) for x, y in pairs))


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
@pytest.mark.parametrize("scheme", [None, "int4", "int8"])
def test_parity_with_torch(loaded, probes, kind: str, scheme: str | None) -> None:
    from clef_local.backends.mlx_backend import DEQUANTIZE_MATMUL, QUANTIZED_MATMUL, ExactQuantizedLinear

    def set_quantized_kernel(model, kernel: str) -> int:
        layers = [m for _, m in model.named_modules() if isinstance(m, ExactQuantizedLinear)]
        for layer in layers:
            layer.kernel = kernel
        return len(layers)

    reference = _probabilities(loaded(kind, scheme, "torch"), probes)
    model = loaded(kind, scheme, "mlx")
    described = model.backend.describe()
    assert described["backend"] == "mlx" and described["backbone_dtype"] == "float32"
    kernels = [DEQUANTIZE_MATMUL, QUANTIZED_MATMUL] if scheme else [None]
    for kernel in kernels:
        if kernel is not None:  # both ways of running the same stored arrays
            assert set_quantized_kernel(model.backend.backbone.model, kernel) > 0
        max_dp, flips = _compare(reference, _probabilities(model, probes))
        assert max_dp <= TOLERANCE, (kind, scheme, kernel, max_dp)
        assert flips == 0
    if scheme:
        set_quantized_kernel(model.backend.backbone.model, DEQUANTIZE_MATMUL)  # back to the CPU default


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_hidden_states_match_torch_and_ignore_padding(loaded, kind: str) -> None:
    """Right padding: real tokens' hidden states equal torch's (mask semantics) and a record's own, unpadded pass."""
    import torch

    torch_model, mlx_model = loaded(kind, None, "torch"), loaded(kind, None, "mlx")
    records = [torch_model.encode(THREE), torch_model.encode({**THREE, "state": "hi"})]
    pad = torch_model.tokenizer.pad_token_id
    length = max(len(r.input_ids) for r in records)
    ids = np.full((2, length), pad, dtype=np.int64)
    mask = np.zeros((2, length), dtype=np.int64)
    for i, r in enumerate(records):
        ids[i, : len(r.input_ids)] = r.input_ids
        mask[i, : len(r.input_ids)] = 1
    expected = torch_model.backend.backbone.forward(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    got = np.array(mlx_model.backend.backbone.hidden_states(mx.array(ids.astype(np.int32))))
    short = len(records[1].input_ids)
    alone = np.array(mlx_model.backend.backbone.hidden_states(mx.array(ids[1:, :short].astype(np.int32))))
    scale = np.abs(expected).max()
    assert np.abs(got[0] - expected[0]).max() <= 1e-5 * scale
    assert np.abs(got[1, :short] - expected[1, :short]).max() <= 1e-5 * scale
    assert np.abs(got[1, :short] - alone[0]).max() <= 1e-5 * scale


def test_int8_and_int4_map_exactly_onto_mlx_arrays(variants, loaded) -> None:
    """Every quantized layer: MLX's dequantized weight (× row scale for int8) equals quant's float32 dequantize
    bit for bit; nothing is re-quantized."""
    import torch
    from safetensors.torch import load_file

    from clef_local.backends.mlx_backend import ExactQuantizedLinear
    from clef_local.quant import int4, int8

    for scheme in ("int8", "int4"):
        path = variants[("qwen3_5", scheme)]
        stored = load_file(str(path / "model.safetensors"))
        model = loaded("qwen3_5", scheme, "mlx")
        layers = {name: m for name, m in model.backend.backbone.model.named_modules()
                  if isinstance(m, ExactQuantizedLinear)}
        assert len(layers) == model.release.quantization["clef_local"]["quantized"]
        for name, layer in layers.items():
            prefix = name.replace("language_model.model.", "model.language_model.", 1)
            got = layer.dequantized()
            if scheme == "int8":
                assert layer.bits == 8 and np.all(np.array(layer.scales) == 1)
                assert np.all(np.array(layer.biases) == -128)
                got = got * layer.row_scale[:, None]
                expected = int8.dequantize({"weight": stored[prefix + ".weight"],
                                            "weight_scale": stored[prefix + ".weight_scale"]}, torch.float32)
            else:
                assert layer.bits == 4 and np.array_equal(np.array(layer.weight),
                                                          stored[prefix + ".weight"].numpy())
                packed = {k: stored[f"{prefix}.{k}"] for k in ("weight", "scales", "biases")}
                packed["weight"] = packed["weight"].view(torch.int32)
                expected = int4.dequantize(packed, layer.group_size, torch.float32)
            got_bits = np.array(got.astype(mx.float32)).view(np.uint32)
            assert np.array_equal(got_bits, expected.numpy().view(np.uint32)), (scheme, name)


@pytest.mark.parametrize("scheme", ["nf4", "fp8"])
def test_nf4_fp8_are_dequantized_with_a_warning(variants, probes, scheme: str, caplog) -> None:
    path = variants[("llama", scheme)]
    reference = _probabilities(clef_local.load(path, backend="torch", dtype="float32"), probes[:3])
    with caplog.at_level(logging.WARNING, logger="clef_local.backends.mlx_weights"):
        model = clef_local.load(path, backend="mlx", dtype="float32", device="cpu")
    assert any(f"no {scheme} kernel" in r.getMessage() for r in caplog.records)
    assert model.backend.describe()["kernels"] == {f"{scheme}:dequantize_at_load": 14}
    max_dp, flips = _compare(reference, _probabilities(model, probes[:3]))
    assert max_dp <= TOLERANCE and flips == 0


def _with_config(source: Path, dest: Path, edit) -> Path:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_rope_theta_from_transformers5_config(tiny_llama: Path, tmp_path: Path, caplog) -> None:
    """A config with rope_parameters only: mlx-lm alone reads theta 10000; the backend passes 100000 and checks."""
    from clef_local.backends.mlx_backend import mlx_lm_rope_theta

    path = _with_config(tiny_llama, tmp_path / "llama", lambda c: c.pop("rope_theta"))
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert mlx_lm_rope_theta(config) == 10000.0  # the trap of docs/hardware.md, known traps
    with caplog.at_level(logging.WARNING, logger="clef_local.backends.mlx_backend"):
        model = clef_local.load(path, backend="mlx", dtype="float32", device="cpu")
    assert any("rope_theta 10000" in r.getMessage() for r in caplog.records)
    ropes = [m for n, m in model.backend.backbone.model.named_modules() if n.endswith("rope")]
    assert len(ropes) == 2 and all(r.base == 100000.0 and r.dims == 16 for r in ropes)
    assert model.backend.describe()["rope_theta"] == 100000.0


def test_rope_check_rejects_a_wrong_theta(tiny_llama: Path, tiny_qwen: Path) -> None:
    import mlx_lm.models.llama as mlx_llama

    from clef_local.backends.mlx_backend import check_rope, source_rope

    config = json.loads((tiny_llama / "config.json").read_text())
    raw = {k: v for k, v in config.items() if k != "rope_theta"}
    plain = mlx_llama.Model(mlx_llama.ModelArgs.from_dict(raw))  # what a plain mlx-lm conversion builds
    with pytest.raises(ReleaseError, match=r"theta 10000\.0, 16 rotary dims, but config\.json says theta 100000\.0"):
        check_rope(plain, config, 16)
    with pytest.raises(ReleaseError, match="disagree"):
        source_rope({**config, "rope_theta": 10000.0})
    qwen = json.loads((tiny_qwen / "config.json").read_text())["text_config"]
    assert source_rope(qwen) == (10000000.0, "default", 0.5)  # 8 of 16 head dims rotate


def test_qwen_rope_checked_on_load(loaded) -> None:
    model = loaded("qwen3_5", None, "mlx")
    ropes = [m for n, m in model.backend.backbone.model.named_modules() if n.endswith("rope")]
    assert ropes and all(r.base == 1e7 and r.dims == 8 for r in ropes)


def test_head_names_and_shapes_equal_the_torch_heads() -> None:
    import torch

    from clef_local.formats.head_config import HeadConfig, head_tensor_shapes
    from clef_local.heads.torch_head import JointSchemaHead

    config = HeadConfig(hidden_size=40, width=24, routing_layers=2, layers=3, heads=4, feedforward=48)
    with torch.device("meta"):
        state = JointSchemaHead(config).state_dict()
    assert head_tensor_shapes(config) == {name: tuple(t.shape) for name, t in state.items()}


def test_head_is_loaded_strictly(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = _with_config(tiny_llama, tmp_path / "llama", lambda c: None)
    head = load_file(str(path / "joint_head.safetensors"))
    head["extra.weight"] = np.zeros(2, np.float32)
    head.pop("residual_gate")
    save_file(head, str(path / "joint_head.safetensors"))
    with pytest.raises(ReleaseError, match=r"missing tensors: residual_gate; unexpected tensors: extra\.weight"):
        clef_local.load(path, backend="mlx", device="cpu")


_TORCH_FREE = """
import json, sys
sys.modules["torch"] = None  # any import of torch now fails
import clef_local
model = clef_local.load(sys.argv[1], backend="mlx", dtype="float32", device="cpu")
prediction = model.predict([json.loads(sys.argv[2])])[0]
real = sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "torch" and v is not None)
print(json.dumps({"p": [list(map(float, p)) for p in prediction.probabilities], "torch_modules": real,
                  "answers": model.decide(json.loads(sys.argv[2]))["answers"]}))
"""


def test_runs_without_torch(variants, loaded) -> None:
    path = variants[("llama", "int8")]
    result = subprocess.run([sys.executable, "-c", _TORCH_FREE, str(path), json.dumps(THREE)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["torch_modules"] == []
    assert set(out["answers"]) == set(THREE["questions"])
    reference = loaded("llama", "int8", "torch").predict([THREE])[0].probabilities
    for p, q in zip(reference, out["p"], strict=True):
        assert np.abs(p - np.array(q)).max() <= TOLERANCE


_DEMO_WORKER = """
import json, sys
import clef_local
requests = json.loads(sys.stdin.read())
model = clef_local.load(sys.argv[1], backend="mlx", dtype="float32", device="cpu")
print(json.dumps([[list(map(float, p)) for p in r.probabilities] for r in model.predict(requests, batch_size=4)]))
"""


@pytest.mark.slow
def test_demo_model_parity(demo_release: Path, tmp_path: Path) -> None:
    """bf16 reference (run in float32), int4 and int8 of the demo model: MLX vs torch on 2 probes + THREE."""
    from clef_local.data.probes import probe_requests
    from clef_local.export.quantize import quantize_release

    requests = [THREE, *probe_requests(2, seed=5)]
    env = dict(os.environ)
    if OPENBLAS.is_file():  # MLX's Linux CPU wheel ships a reference BLAS (docs/hardware.md, known traps)
        env["LD_PRELOAD"] = str(OPENBLAS)
    for scheme in (None, "int4", "int8"):
        path = demo_release
        if scheme:
            path = tmp_path / scheme
            quantize_release(demo_release, path, scheme, validate=False, log_summary=False)
        torch_model = clef_local.load(path, backend="torch", dtype="float32")
        if scheme:
            assert torch_model.backend.describe()["kernels"] == {f"{scheme}:dequantize": 210}
        reference = _probabilities(torch_model, requests)
        del torch_model
        result = subprocess.run([sys.executable, "-c", _DEMO_WORKER, str(path)], input=json.dumps(requests),
                                capture_output=True, text=True, timeout=900, env=env, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        got = [[np.array(p, dtype=np.float32) for p in r] for r in json.loads(result.stdout.strip().splitlines()[-1])]
        max_dp, flips = _compare(reference, got)
        assert max_dp <= TOLERANCE, (scheme, max_dp)
        assert flips == 0
