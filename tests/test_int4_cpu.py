"""int4 and int8 on a CPU (clef_local/quant/int4_cpu.py, int8.blocked_matmul, Int4Linear's int4pack_cpu): torch's
kernel layout read back exactly, both int4 paths (torch's packed kernel, the blocked dequantize of the same bytes)
against ``int4.dequantize`` in float32, and one 4-bit copy per layer.

Tolerances: bf16 activations give ``x @ W.T`` rounded to bf16 plus bf16 rounding of the activations' products'
accumulation, so outputs are held to ``|y − ref| ≤ 2⁻⁷ · max |ref|`` (3 bf16 ulps of the largest output); the
dequantized weights themselves are held to bit equality with ``int4.dequantize(…, bfloat16)``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from clef_local.backends import quantized as ql
from clef_local.quant import int4, int4_cpu, int8

BF16_BOUND = 2**-7


def _weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)).mul_(0.05).to(torch.bfloat16)


def _x(rows: int, in_f: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, in_f, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _relative(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.float() - reference).abs().max() / reference.abs().max())


def test_this_torch_packs_in_a_known_layout() -> None:
    layout = int4_cpu.cpu_layout()
    assert layout is not None  # x86 (AVX512: 64 rows, lanes; AVX2: 32, lanes) and arm64 (32, pairs) builds
    for rows, cols, seed in ((16, 32, 0), (48, 64, 1), (64, 64, 2), (80, 128, 3), (1040, 96, 4), (208, 256, 5)):
        q = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        ours = int4_cpu.pack(q, layout)
        assert torch.equal(ours, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).view(torch.uint8))


@pytest.mark.parametrize("layout", int4_cpu.CANDIDATES, ids=str)
def test_every_candidate_layout_unpacks_its_own_bytes(layout: int4_cpu.PackLayout) -> None:
    """With s = 1 and z = 0 the dequantize returns q − 8: every layout (this machine's or not), full blocks and a
    shorter last one, from any block-aligned start."""
    rows, cols = 3 * 64 + 16, 64
    q = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    pairs = torch.stack([torch.ones(cols // 32, rows), torch.zeros(cols // 32, rows)], dim=-1)
    repacked = int4.TorchInt4(int4_cpu.pack(q, layout), 32, pairs)
    for start, stop in ((0, rows), (layout.block, rows), (0, 2 * layout.block), (rows - 16, rows)):
        if start % layout.block:
            continue
        out = torch.empty(cols, stop - start)
        assert torch.equal(int4_cpu.dequantize_t(repacked, layout, start, stop, out), (q[start:stop] - 8).T.float())


@pytest.mark.parametrize(("out_f", "in_f", "group"), [(64, 128, 32), (272, 256, 64), (1040, 384, 128),
                                                      (48, 64, 32), (336, 512, 64)])
def test_both_paths_match_dequantize(out_f: int, in_f: int, group: int) -> None:
    stored = int4.quantize(_weight(out_f, in_f, out_f), group)
    layout = int4_cpu.cpu_layout()
    repacked = int4_cpu.repack(stored, group, torch.bfloat16, layout)
    codes = int4.unpack(stored["weight"]).to(torch.int32).contiguous()
    assert torch.equal(repacked.weight, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).view(torch.uint8))
    w_t = int4_cpu.dequantize_t(repacked, layout, 0, out_f, torch.empty(in_f, out_f, dtype=torch.bfloat16))
    assert torch.equal(w_t.T, int4.dequantize(stored, group, torch.bfloat16))
    dense = int4.dequantize(stored, group, torch.float32)
    for rows in (1, 7, 129, 300):
        x = _x(rows, in_f, rows)
        reference = x.float() @ dense.T
        kernel = int4_cpu.matmul(x, repacked, kernel_rows=rows + 1)
        blocked = int4_cpu.matmul(x, repacked, kernel_rows=0)
        assert kernel.dtype == blocked.dtype == torch.bfloat16 and blocked.shape == (rows, out_f)
        assert _relative(kernel, reference) <= BF16_BOUND, ("kernel", rows)
        assert _relative(blocked, reference) <= BF16_BOUND, ("blocked", rows)
    small = int4_cpu.blocked_matmul(x, repacked, layout, chunk=64)  # many blocks, the last one shorter
    assert _relative(small, reference) <= BF16_BOUND


def _loaded(stored: dict[str, torch.Tensor], scheme: str, out_f: int, in_f: int, dtype: torch.dtype) -> nn.Module:
    headers = {f"0.{k}": (tuple(v.shape), v.dtype) for k, v in stored.items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(in_f, out_f, bias=False))
    ql.swap_linears(model, ql.quantized_prefixes(headers, scheme), headers, dtype=dtype)
    model.load_state_dict({f"0.{k}": v.clone() for k, v in stored.items()}, strict=True, assign=True)
    ql.prepare_quantized(model)
    return model[0]


def test_the_int4_layer_holds_one_4bit_copy_and_picks_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    out_f, in_f, group = 320, 256, 64
    stored = int4.quantize(_weight(out_f, in_f, 1), group)
    layer = _loaded(stored, "int4", out_f, in_f, torch.bfloat16)
    assert (layer.kernel, layer.kernel_reason) == ("int4pack_cpu", "")
    assert layer.weight is None and layer.scales is None and layer.biases is None  # the stored copy is released
    held = sum(t.numel() * t.element_size() for t in layer.buffers())
    assert held == out_f * in_f // 2 + 2 * 2 * out_f * in_f // group  # codes + bf16 (s, z) per group
    calls = []
    blocked = int4_cpu.blocked_matmul
    monkeypatch.setattr(int4_cpu, "blocked_matmul", lambda *a, **k: calls.append(a[0].shape[0]) or blocked(*a, **k))
    reference = int4.dequantize(stored, group, torch.float32)
    for rows in (3, int4_cpu.KERNEL_ROWS - 1, int4_cpu.KERNEL_ROWS, 2 * int4_cpu.KERNEL_ROWS + 1):
        x = _x(rows, in_f, rows).reshape(1, rows, in_f)  # leading dimensions kept
        y = layer(x)
        assert y.shape == (1, rows, out_f) and y.dtype == torch.bfloat16
        assert _relative(y[0], x[0].float() @ reference.T) <= BF16_BOUND
    assert calls == [int4_cpu.KERNEL_ROWS, 2 * int4_cpu.KERNEL_ROWS + 1]  # from KERNEL_ROWS on: the blocked path


def test_a_layer_torchs_kernel_cannot_hold_dequantizes_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    stored = int4.quantize(_weight(24, 64, 2), 32)
    with caplog.at_level(logging.INFO, logger="clef_local.backends.quantized"):
        layer = _loaded(stored, "int4", 24, 64, torch.bfloat16)
    assert (layer.kernel, layer.kernel_reason) == ("dequantize", "out_features 24 is not a multiple of 16 (torch's "
                                                                 "CPU int4 kernel)")
    assert "1 × int4:dequantize (out_features 24" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    float32 = _loaded(int4.quantize(_weight(32, 64, 3), 32), "int4", 32, 64, torch.float32)
    assert (float32.kernel, float32.kernel_reason) == ("dequantize", "")  # a choice: no fast int4 path in float32


def test_a_wrong_layout_fails_the_load_check_and_dequantizes(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    real = int4_cpu.cpu_layout()
    wrong = next(c for c in int4_cpu.CANDIDATES if c.lanes != real.lanes)
    monkeypatch.setattr(int4_cpu, "cpu_layout", lambda: wrong)
    stored = int4.quantize(_weight(128, 128, 4), 32)
    layer = _loaded(stored, "int4", 128, 128, torch.bfloat16)
    assert layer.kernel == "dequantize" and layer.kernel_reason.startswith("int4pack_cpu self-check failed")
    assert "disagrees with the blocked dequantize of the same bytes" in caplog.text
    x = _x(5, 128, 5)
    assert _relative(layer(x), x.float() @ int4.dequantize(stored, 32, torch.float32).T) <= BF16_BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_blocked_matmul_matches_dequantize(dtype: torch.dtype) -> None:
    stored = int8.quantize(_weight(600, 256, 6).float())
    reference_w = int8.dequantize(stored, torch.float32)
    bound = 1e-5 if dtype == torch.float32 else BF16_BOUND
    for rows in (1, 65, 300):
        x = _x(rows, 256, rows).to(dtype)
        reference = x.float() @ reference_w.T
        y = int8.blocked_matmul(x.reshape(1, rows, 256), stored, chunk=256)  # blocks of 256, 256 and 88
        assert y.shape == (1, rows, 600) and y.dtype == dtype
        assert _relative(y[0], reference) <= bound, (dtype, rows)
        layer = _loaded(stored, "int8", 600, 256, dtype)
        assert _relative(layer(x), reference) <= bound, (dtype, rows, layer.kernel)
