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
