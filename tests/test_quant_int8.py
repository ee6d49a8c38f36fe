"""int8 (symmetric per output channel): known values, error bound, torch int8 kernel."""

from __future__ import annotations

import torch

from clef_local.quant import int8


def _weight(out_f: int = 32, in_f: int = 128, seed: int = 0) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def test_known_values_and_layout() -> None:
    w = torch.tensor([[127.0, -63.5, 0.5, 1.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0], [2.54, 0.0, -1.27, 0.01, 0.0]])
    packed = int8.quantize(w)
    assert packed["weight"].dtype == torch.int8 and packed["weight"].shape == (3, 5)
    assert packed["weight_scale"].dtype == torch.float32 and packed["weight_scale"].shape == (3, 1)
    assert packed["weight_scale"][:2, 0].tolist() == [1.0, 1.0]  # zero row: scale 1
    assert packed["weight"][0].tolist() == [127, -64, 0, 2, -127]  # rint: half to even
    assert packed["weight"][1].tolist() == [0] * 5
    assert packed["weight"][2].tolist() == [127, 0, -64, 0, 0]
    assert torch.equal(int8.dequantize(packed)[1], torch.zeros(5))


def test_round_trip_error_within_half_scale() -> None:
    w = _weight(64, 256, seed=1)
    w[3] = 0
    packed = int8.quantize(w)
    deq = int8.dequantize(packed, torch.float32)
    scale = packed["weight_scale"]
    assert int(packed["weight"].abs().max()) == 127 and int(packed["weight"].min()) >= -127
    assert ((deq - w.float()).abs() <= scale / 2 + 2**-22 * w.float().abs()).all()  # + float32 rounding of q*scale
    assert int8.dequantize(packed, torch.bfloat16).dtype == torch.bfloat16


def test_int8_matmul_kernel_and_fallback() -> None:
    packed = int8.quantize(_weight(48, 128, seed=2))
    x = torch.randn(3, 4, 128, generator=torch.Generator().manual_seed(3))
    ref = x @ int8.dequantize(packed).T
    y = int8.int8_matmul(x, packed)  # float32 kernel: exact up to accumulation order
    assert y.shape == (3, 4, 48) and y.dtype == torch.float32
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    yb = int8.int8_matmul(x.to(torch.bfloat16), packed)  # bf16 kernel: bf16 scale and output
    assert yb.dtype == torch.bfloat16
    assert (yb.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    y64 = int8.int8_matmul(x.double(), packed)  # no kernel for float64: dequantize path
    assert y64.dtype == torch.float64 and (y64 - ref.double()).abs().max() <= 1e-5 * ref.abs().max()
    assert int8.bits_per_weight(in_features=4096) == 8 + 32 / 4096
