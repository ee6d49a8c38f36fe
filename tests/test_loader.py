"""Loader decisions with faked hardware (clef_local.planning.choice.plan_load is pure), and through clef_local.load."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import clef_local
from clef_local.errors import ApiUsageError, InsufficientMemoryError
from clef_local.planning.choice import DEQUANTIZE, choose, plan_load
from clef_local.planning.hardware import Hardware, named_device
from clef_local.planning.load_options import LoadOptions
from clef_local.planning.planner import CONFIGS_DIR
from clef_local.units import GiB

CONFIGS = CONFIGS_DIR  # the packaged Clef / Clef-flash shapes
ALL = {"torch": None, "mlx": None, "onnx": None}
NO_MLX = {"torch": None, "mlx": "mlx is not installed (pip install 'clef-local[mlx]')", "onnx": None}
CARD_24 = named_device("rtx4090")  # 24 GB, sm_89
CARD_80 = named_device("h100")  # 80 GB, sm_90
MAC_36 = named_device("mac-36")
CPU_8 = Hardware(kind="cpu", name="an 8 GB box", device="cpu", total_bytes=8 * GiB, free_bytes=8 * GiB, bf16=True,
                 fast_bf16=False, cores=4, host_total_bytes=8 * GiB, host_free_bytes=8 * GiB)
SCHEMES = ("bf16", "int8", "fp8", "int4", "nf4")


@pytest.fixture(scope="module")
def flash():
    from clef_local.planning.planner import footprint_from_config

    return footprint_from_config(CONFIGS / "clef-flash.config.json")


@pytest.fixture(scope="module")
def clef():
    from clef_local.planning.planner import footprint_from_config

    return footprint_from_config(CONFIGS / "clef.config.json")


def _kernels(hw: Hardware, installed=ALL, **kw) -> dict[str, str]:
    return {s: choose(hw, s, installed=installed, **kw).kernel for s in SCHEMES}


def test_cuda_cards_run_torch_with_the_scheme_kernels() -> None:
    for card in (CARD_24, CARD_80):
        d = choose(card, "int4", installed=ALL)
        assert (d.backend, d.device, d.dtype) == ("torch", "cuda:0", "bfloat16")
        assert _kernels(card) == {"bf16": "dense", "int8": "bnb_int8", "fp8": "scaled_mm_rowwise",
                                  "int4": "tinygemm_cuda", "nf4": "bnb_matmul_4bit"}
    ampere = named_device("a100-80g")  # sm_80: no FP8 matmul, weights dequantized per call; tinygemm runs
    assert _kernels(ampere)["fp8"] == DEQUANTIZE and _kernels(ampere)["int4"] == "tinygemm_cuda"
    assert choose(CARD_24, "int8", installed=ALL, bitsandbytes=False).kernel == "int_mm_cuda"  # torch._int_mm
    turing = replace(CARD_24, compute_capability=(7, 5), bf16=False, fast_bf16=False, fp8=False)
    assert choose(turing, "bf16", installed=ALL).dtype == "float16"
    assert choose(turing, "int4", installed=ALL).kernel == DEQUANTIZE  # tinygemm: sm_80+, bf16 only


def test_a_mac_runs_mlx_and_dequantizes_nf4_and_fp8() -> None:
    d = choose(MAC_36, "int4", installed=ALL)
    assert (d.backend, d.device, d.dtype) == ("mlx", "mps", "bfloat16")
    assert _kernels(MAC_36) == {"bf16": "dense", "int8": "mlx_quantized_matmul", "fp8": "dequantize_at_load",
                                "int4": "mlx_quantized_matmul", "nf4": "dequantize_at_load"}
    assert "dequantized at load" in choose(MAC_36, "nf4", installed=ALL).reason
    without = choose(MAC_36, "int4", installed=NO_MLX)
    assert (without.backend, without.device) == ("torch", "cpu") and "clef-local[mlx]" in without.reason


def test_a_cpu_without_amx_runs_torch_in_float32() -> None:
    d = choose(CPU_8, "bf16", installed=ALL)
    assert (d.backend, d.device, d.dtype) == ("torch", "cpu", "float32") and "not measured" in d.reason
    # float32 activations: torch's int4/int8 CPU kernels lose to dequantize-then-matmul; bf16 ones use them (for
    # calls shorter than a prefill; longer ones dequantize the same bytes block by block)
    assert _kernels(CPU_8) == {"bf16": "dense", "int8": DEQUANTIZE, "fp8": DEQUANTIZE,
                               "int4": DEQUANTIZE, "nf4": "bnb_matmul_4bit"}
    assert _kernels(CPU_8, dtype="bfloat16") == {"bf16": "dense", "int8": "torch_int8pack_cpu", "fp8": DEQUANTIZE,
                                                 "int4": "int4pack_cpu", "nf4": "bnb_matmul_4bit"}
    measured_fast = replace(CPU_8, fast_bf16=True, bf16_speedup=1.8)
    assert choose(measured_fast, "bf16", installed=ALL).dtype == "bfloat16"
    assert choose(CPU_8, "bf16", installed=ALL, dtype="bfloat16").dtype == "bfloat16"
    assert choose(CPU_8, "int4", installed=ALL, onnx_export=True).backend == "onnx"
    assert choose(CARD_24, "int4", installed=ALL, onnx_export=True).backend == "torch"  # onnx only on the CPU


def test_unavailable_backends_name_the_available_ones() -> None:
    with pytest.raises(ApiUsageError, match=r"'mlx' is not available here: mlx is not installed .*available: torch, "
                                            r"onnx"):
        choose(CPU_8, "bf16", backend="mlx", installed=NO_MLX)
    with pytest.raises(ApiUsageError, match="unknown backend 'tensorrt'; choose one of auto, torch, mlx, onnx"):
        choose(CPU_8, "bf16", backend="tensorrt", installed=ALL)
    with pytest.raises(ApiUsageError, match=r"bitsandbytes.*int4"):
        choose(CARD_24, "nf4", installed=ALL, bitsandbytes=False)


def test_24gb_card_refuses_bf16_clef_and_suggests_4_bits(flash, clef) -> None:
    l4 = named_device("l4")  # a "24 GB" sm_89 card with 22.5 GiB usable
    with pytest.raises(InsufficientMemoryError) as info:
        plan_load(l4, "bf16", clef, context=16384, installed=ALL, source="clef")
    message = str(info.value)
    # what a card just large enough would run: the prefill in 8,192-token chunks (docs/hardware.md#chunked-prefill)
    assert "bf16 on torch needs 53.9 GiB at 16,384 tokens, 22.5 GiB free on cuda:0 (NVIDIA L4)" in message
    assert "try --bits 4: clef-local quantize --bits 4 --model clef --out clef-int4" in message
    # Clef 27B int4 at 16K fits once embed_tokens and lm_head stay in host memory (torch on CUDA, docs/hardware.md).
    ok = plan_load(l4, "int4", clef, context=16384, installed=ALL)
    assert 20 * GiB < ok.need_bytes < ok.available_bytes == l4.free_bytes
    assert plan_load(l4, "bf16", flash, context=16384, installed=ALL).need_bytes < l4.free_bytes


def test_24gb_card_and_27b(clef) -> None:
    with pytest.raises(InsufficientMemoryError, match="try --bits 4"):
        plan_load(CARD_24, "int8", clef, context=4096, installed=ALL, source="clef")
    assert plan_load(CARD_24, "int4", clef, context=4096, installed=ALL).kernel == "tinygemm_cuda"
    # at 65,536 tokens the prefill runs in chunks and fits; at 131,072 the keys, values and the head's memory do not
    fits = plan_load(CARD_24, "int4", clef, context=65536, installed=ALL)
    assert fits.need_bytes <= fits.available_bytes and fits.context == 65536
    with pytest.raises(InsufficientMemoryError, match=r"try max_length=\d+ \(a context of [\d,]+ tokens fits\)"):
        plan_load(CARD_24, "int4", clef, context=131072, installed=ALL)


def test_80gb_card_holds_bf16_clef(clef) -> None:
    d = plan_load(CARD_80, "bf16", clef, context=16384, installed=ALL)
    assert (d.backend, d.dtype, d.kernel) == ("torch", "bfloat16", "dense")
    assert 50 * GiB < d.need_bytes < 80 * GiB
    assert plan_load(CARD_80, "fp8", clef, context=16384, installed=ALL).kernel == "scaled_mm_rowwise"


def test_36gb_mac(flash, clef) -> None:
    assert plan_load(MAC_36, "bf16", flash, context=8192, installed=ALL).backend == "mlx"
    assert plan_load(MAC_36, "int4", clef, context=4096, installed=ALL).kernel == "mlx_quantized_matmul"
    with pytest.raises(InsufficientMemoryError, match=r"nf4 on mlx needs .* GiB free on mps .*try --bits 4"):
        plan_load(MAC_36, "nf4", clef, context=4096, installed=ALL)  # dequantized at load: bf16-sized


def test_8gb_cpu_box(flash) -> None:
    with pytest.raises(InsufficientMemoryError) as info:
        plan_load(CPU_8, "int4", flash, context=4096, installed=ALL)
    assert "GiB free on cpu (an 8 GB box)" in str(info.value) and "a device with more memory" in str(info.value)
    assert plan_load(CPU_8, "int4", flash, context=4096, installed=ALL,
                     options=LoadOptions(check_memory=False)).backend == "torch"


def test_load_records_the_decision_and_refuses_with_too_little_memory(tiny_llama: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = clef_local.load(tiny_llama)
    loader = model.describe()["loader"]
    assert loader["backend"] == "torch" and loader["device"] == "cpu" and loader["scheme"] == "bf16"
    assert loader["need_bytes"] < loader["available_bytes"]
    tiny_box = replace(CPU_8, free_bytes=100 << 20, total_bytes=100 << 20)
    monkeypatch.setattr("clef_local.planning.hardware.detect", lambda device="auto", **_: tiny_box)
    with pytest.raises(InsufficientMemoryError, match=r"needs 0\.\d GiB at .* tokens, 0\.1 GiB free on cpu"):
        clef_local.load(tiny_llama)


@pytest.fixture(scope="module")
def llama_variants(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from clef_local.export.quantize import quantize_release

    out = {}
    for scheme in ("int8", "int4"):
        out[scheme] = tmp_path_factory.mktemp("loader") / scheme
        quantize_release(tiny_llama, out[scheme], scheme, validate=False, log_summary=False)
    return out


def test_decided_kernels_are_the_ones_the_torch_backend_records(llama_variants: dict[str, Path]) -> None:
    for scheme, variant in llama_variants.items():
        info = clef_local.load(variant).describe()
        assert info["loader"]["scheme"] == scheme and info["backend"] == "torch"
        assert set(info["kernels"]) == {f"{scheme}:{info['loader']['kernel']}"}


def test_decided_kernels_are_the_ones_the_mlx_backend_records(llama_variants: dict[str, Path]) -> None:
    pytest.importorskip("mlx.core")
    pytest.importorskip("clef_local.backends.mlx_backend")
    for scheme, variant in llama_variants.items():
        info = clef_local.load(variant, backend="mlx").describe()
        assert (info["loader"]["backend"], info["loader"]["dtype"]) == ("mlx", "float32")
        assert set(info["kernels"]) == {f"{scheme}:{info['loader']['kernel']}"}


def test_onnx_runs_on_a_card_only_with_the_cuda_provider() -> None:
    assert choose(CARD_24, "int4", backend="onnx", installed=ALL).device == "cpu"
    on_card = choose(CARD_24, "int4", backend="onnx", installed=ALL, onnx_cuda=True)
    assert on_card.device == CARD_24.device and on_card.backend == "onnx"
    assert choose(CPU_8, "int4", backend="onnx", installed=ALL, onnx_cuda=True).device == "cpu"
