"""fp8 (float8_e4m3fn, per-channel scale): known encodings, error bound, dtypes."""

from __future__ import annotations

import torch

from clef_local.quant import fp8


def test_known_encodings() -> None:
    # Row max 448 -> scale 1, so the stored bytes are the e4m3fn encodings of the values themselves.
    w = torch.tensor([[448.0, -448.0, 1.0, 1.0625, 0.0, 2.0**-9, -(2.0**-6), 3.5]])
    packed = fp8.quantize(w)
    assert packed["weight"].dtype == torch.float8_e4m3fn and packed["weight"].shape == (1, 8)
    assert packed["weight_scale"].dtype == torch.float32 and packed["weight_scale"].tolist() == [[1.0]]
    # 448 = 0x7E, 1.0 = 0x38, 1.0625 ties to even -> 1.0, 2^-9 = smallest subnormal 0x01, -2^-6 = 0x88, 3.5 = 0x46
    assert packed["weight"].view(torch.uint8)[0].tolist() == [0x7E, 0xFE, 0x38, 0x38, 0x00, 0x01, 0x88, 0x46]


def test_round_trip_within_e4m3_bound() -> None:
    generator = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=generator) * 0.05).to(torch.bfloat16)
    w[5] = 0
    w[6, :10] = 1e-6  # subnormal region after scaling
    packed = fp8.quantize(w)
    scale = packed["weight_scale"]
    assert scale[5].item() == 1.0
    deq = fp8.dequantize(packed)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    assert fp8.dequantize(packed, torch.bfloat16).dtype == torch.bfloat16
    wf = w.float()
    normal = (wf / scale).abs() >= 2.0**-6
    bound = torch.where(normal, 2.0**-4 * wf.abs(), 2.0**-10 * scale.expand_as(wf))  # 3 mantissa bits / subnormal
    assert ((deq - wf).abs() <= bound * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(deq[5], torch.zeros(256))
    assert (packed["weight"].float().abs().amax(dim=1)[torch.arange(64) != 5] == 448).all()
