"""The scheme registry: uniform signatures, config dicts, bits per weight; quant imports nothing else."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from clef_local import quant


def test_registry_round_trips_every_scheme() -> None:
    assert set(quant.SCHEMES) == {"int4", "int8", "nf4", "fp8"}
    w = (torch.randn(32, 128, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    bounds = {"int4": 0.1, "int8": 0.01, "nf4": 0.1, "fp8": 0.07}  # max error / max |w|
    for name, scheme in quant.SCHEMES.items():
        assert quant.get(name) is scheme and scheme.name == name
        packed = scheme.quantize(w, scheme.default_group_size)
        assert "weight" in packed and all(isinstance(t, torch.Tensor) for t in packed.values())
        deq = scheme.dequantize(packed, scheme.default_group_size, torch.float32)
        assert deq.shape == w.shape and deq.dtype == torch.float32
        assert (deq - w.float()).abs().max() <= bounds[name] * w.float().abs().max(), name
        assert 4 <= scheme.bits_per_weight(scheme.default_group_size) <= 9
        config = scheme.quantization_config(scheme.default_group_size)
        assert json.loads(json.dumps(config)) == config and config["quant_method"]
    with pytest.raises(ValueError, match="known: int4"):
        quant.get("int3")


def test_config_dicts_and_group_sizes() -> None:
    int4 = quant.get("int4")
    assert int4.quantization_config(32) == {
        "quant_method": "clef-local",
        "scheme": "int4",
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "layout": "mlx",
        "grid": "mse",
    }
    assert int4.quantization_config(64, grid="mlx")["grid"] == "mlx"
    assert quant.int4.mlx_quantization(64) == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert int4.predicate_group_size() == 64 and int4.predicate_group_size(128) == 128
    assert quant.get("nf4").predicate_group_size(64) is None and quant.get("int8").predicate_group_size() is None
    assert quant.get("nf4").quantization_config(64, skip_modules=["lm_head"])["llm_int8_skip_modules"] == ["lm_head"]
    fp8 = quant.get("fp8").quantization_config(skip_modules=["lm_head", "a.b"])
    assert (fp8["quant_method"], fp8["format"], fp8["ignore"]) == ("compressed-tensors", "float-quantized",
                                                                  ["a.b", "lm_head"])
    assert fp8["config_groups"]["group_0"]["weights"]["type"] == "float"
    int8 = quant.get("int8").quantization_config()
    assert (int8["format"], int8["config_groups"]["group_0"]["weights"]["type"]) == ("int-quantized", "int")
    assert int4.top_level_config(32) == {"quantization": {"group_size": 32, "bits": 4, "mode": "affine"}}
    assert quant.get("fp8").top_level_config() == {}
    assert quant.get("int4").bits_per_weight(128) == 4.25


def test_quant_imports_nothing_of_clef_local() -> None:
    for path in Path(quant.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("clef_local"), path.name
            elif isinstance(node, ast.Import):
                assert not any(alias.name.startswith("clef_local") for alias in node.names), path.name


def test_each_row_agrees_with_its_scheme_and_its_consumers() -> None:
    """A row's numbers are its scheme module's, its stored bytes are what quantize writes, and every name it gives
    (torch module, MLX loader, ONNX builder, synthetic fake) resolves where it says; importing the rows needs no
    torch."""
    import subprocess
    import sys

    from clef_local import synthetic
    from clef_local.backends import mlx_weights, quantized
    from clef_local.export.onnx import graph
    from clef_local.formats.safetensors import DTYPES
    from clef_local.quant import registry

    code = "import sys; from clef_local.quant import registry; registry.get('int4'); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
    assert quant.get("int4").default_group_size == quant.int4.DEFAULT_GROUP_SIZE
    assert quant.get("int4").group_sizes == quant.int4.GROUP_SIZES
    assert dict(quant.get("int4").options) == {"grid": quant.int4.DEFAULT_GRID}
    assert quant.get("nf4").default_group_size == quant.nf4.DEFAULT_BLOCKSIZE
    w = (torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    for name, row in registry.SCHEMES.items():
        packed = row.quantize(w, row.default_group_size)
        stored = sum(t.numel() * t.element_size() for t in packed.values())
        assert row.stored_bytes(48, 256, 2, row.default_group_size or 64, "bfloat16") == stored, name
        assert getattr(torch, DTYPES[row.weight_dtype].torch) == packed["weight"].dtype, name
        assert quantized.MODULES[name].scheme == name
        assert callable(getattr(synthetic, row.fake)) and callable(getattr(mlx_weights, row.mlx_loader))
        assert row.onnx_nbits is None or callable(getattr(graph, row.onnx_nbits))
        assert set(row.validation) == {"mean_kl", "flip_rate"}
        assert row.flag in (f"--bits {row.bits}", f"--format {name}")
        assert set(row.kernels) >= {("torch", "cpu"), ("torch", "cuda"), ("mlx", "apple"), ("onnx", "cpu")}
