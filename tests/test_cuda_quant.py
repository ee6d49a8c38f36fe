"""CUDA kernels of quantized variants (run by benchmarks/gpu_check.sh on a GPU machine; skipped cleanly without CUDA).

Tolerances (bf16 activations, error / max |x @ W.T| against dequantize-then-matmul in float32): nf4 through
bitsandbytes ≤ 1e-2; int4 dequantize ≤ 1e-2; int8 through bitsandbytes (activations quantized per token to int8)
≤ 3e-2; fp8 through ``torch._scaled_mm`` on sm_89+ (activations quantized per token to e4m3) ≤ 5e-2. A variant's
decisions on CUDA in bf16 vs the same variant on CPU in float32: max |Δp| ≤ 0.05 (the bound of test_cuda.py's bf16
backbone).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from request_gen import varied_requests
from test_variant_loading import GROUP, make_variant
from torch import nn

import clef_local
from clef_local import quant
from clef_local.backends import quantized as ql

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SM89 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
SM80 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
CUDA_KERNEL = {"int4": "tinygemm_cuda" if SM80 else "dequantize", "int8": "bnb_int8", "nf4": "bnb_matmul_4bit",
               "fp8": "scaled_mm_rowwise" if SM89 else "dequantize"}
TOLERANCE = {"int4": 1e-2, "int8": 3e-2, "nf4": 1e-2, "fp8": 5e-2}


def _cuda_layer(scheme: str, dtype: torch.dtype, out_f: int = 256, in_f: int = 512):
    """One linear layer of ``scheme`` loaded the two-phase way and prepared on CUDA; its float32 dequantized W."""
    group = GROUP[scheme] or quant.get(scheme).default_group_size
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)) * 0.02
    stored = quant.get(scheme).quantize(weight.to(torch.bfloat16), group)
    state = {f"0.{k}": v for k, v in stored.items()}
    headers = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(in_f, out_f, bias=False))
    ql.swap_linears(model, ql.quantized_prefixes(headers, scheme), headers, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.to("cuda")
    layers = ql.prepare_quantized(model)
    return model[0], quant.get(scheme).dequantize(stored, group, torch.float32).cuda(), layers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", list(GROUP))
def test_cuda_layer_matches_dequantize_then_matmul(scheme: str, dtype: torch.dtype):
    if scheme in ("int8", "nf4"):
        pytest.importorskip("bitsandbytes")
    layer, weight, layers = _cuda_layer(scheme, dtype)
    kernel = "dequantize" if scheme == "int4" and dtype != torch.bfloat16 else CUDA_KERNEL[scheme]  # tinygemm: bf16
    assert layers == {"0": f"{scheme}:{kernel}"}, layer.kernel_reason
    worst = 0.0
    for tokens in (1, 21):  # bitsandbytes takes a gemv path for one token
        x = torch.randn(tokens, weight.shape[1], device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        x = x.to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert y.dtype == dtype and y.device.type == "cuda"
        reference = x.float() @ weight.T
        worst = max(worst, float((y.float() - reference).abs().max() / reference.abs().max()))
    print(f"cuda {scheme} {dtype} via {layer.kernel}: max error / max |x @ W.T| = {worst:.2e}")
    assert worst <= TOLERANCE[scheme]


def test_cuda_int8_through_int_mm_matches_dequantize_then_matmul():
    """int8 without bitsandbytes: ``torch._int_mm`` on int8 activations (W8A8), short calls padded to 17 rows."""
    layer, weight, _ = _cuda_layer("int8", torch.bfloat16)
    layer.use_int_mm()
    worst = 0.0
    for tokens in (1, 16, 21, 300):
        x = torch.randn(tokens, weight.shape[1], device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
        with torch.inference_mode():
            y = layer(x.to(torch.bfloat16))
        reference = x.to(torch.bfloat16).float() @ weight.T
        assert y.dtype == torch.bfloat16 and y.shape == reference.shape
        worst = max(worst, float((y.float() - reference).abs().max() / reference.abs().max()))
    print(f"cuda int8 via torch._int_mm: max error / max |x @ W.T| = {worst:.2e}")
    assert worst <= TOLERANCE["int8"]


@pytest.mark.skipif(not SM89, reason="torch._scaled_mm with fp8 needs sm_89+")
def test_fp8_scaled_mm_is_not_a_silent_dequantize():
    layer, _, _ = _cuda_layer("fp8", torch.bfloat16)
    assert layer.kernel == "scaled_mm_rowwise" and layer.scale_row.shape == (1, layer.out_features)


@pytest.fixture(scope="module")
def llama_variants(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("cuda-variants")
    return {s: make_variant(tiny_llama, root / s, s, GROUP[s]) for s in GROUP}


@pytest.mark.parametrize("scheme", list(GROUP))
def test_variant_decides_on_cuda_close_to_cpu(llama_variants, scheme: str):
    if scheme in ("int8", "nf4"):
        pytest.importorskip("bitsandbytes")
    cpu = clef_local.load(llama_variants[scheme], dtype="float32")
    gpu = clef_local.load(llama_variants[scheme], device="cuda", dtype="bfloat16")
    kernels = gpu.describe()["kernels"]
    assert kernels == {f"{scheme}:{CUDA_KERNEL[scheme]}": len(cpu.backend.backbone.layers)}
    requests = varied_requests(12, seed=7)[:9]
    worst = max(float(np.abs(a - b).max())
                for c, g in zip(cpu.predict(requests), gpu.predict(requests), strict=True)
                for a, b in zip(c.probabilities, g.probabilities, strict=True))
    print(f"{scheme}: max |Δp| cuda bf16 ({kernels}) vs cpu float32: {worst:.2e}")
    assert worst <= 0.05


@pytest.mark.skipif(not SM80, reason="tinygemm needs sm_80+")
@pytest.mark.parametrize(("out_f", "in_f", "group"), [(256, 512, 64), (200, 96, 32), (64, 1024, 128)])
def test_tinygemm_repack_is_exact(out_f: int, in_f: int, group: int):
    """Every inner_k_tiles (512 → 8, 96 → 2, 1024 → 8) and group size: tinygemm equals bf16 x @ dequantize(W).T up to
    the kernel's own bf16 accumulation; a wrong nibble order or zero point would be off by far more."""
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(out_f)) * 0.02
    stored = quant.int4.quantize(weight.to(torch.bfloat16), group)
    packed = {k: v.cuda() for k, v in stored.items()}
    repacked = ql.repack_int4(packed, group, torch.bfloat16, rows=64 * in_f, convert=quant.int4.to_tinygemm)
    x = torch.randn(7, in_f, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).to(torch.bfloat16)
    reference = x.float() @ quant.int4.dequantize(stored, group, torch.float32).cuda().T
    error = float((quant.int4.tinygemm_matmul(x, repacked).float() - reference).abs().max() / reference.abs().max())
    print(f"tinygemm [{out_f}, {in_f}] g{group}: max error / max |x @ W.T| = {error:.2e}")
    assert error <= 1e-2
