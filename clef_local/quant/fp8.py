"""fp8: float8_e4m3fn weights with one float32 scale per output row (compressed-tensors' FP8 weight layout).

The rule, its error bound and the stored keys: docs/quantization.md#the-rounding-rules-exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _rowwise, compressed

BITS = 8
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
QMAX = FP8_MAX
CODE_DTYPE = FP8_DTYPE


def codes(values: torch.Tensor) -> torch.Tensor:
    """``w / scale`` clamped to ±448 (in place) and rounded to nearest by the cast to float8_e4m3fn."""
    return values.clamp_(-FP8_MAX, FP8_MAX).to(CODE_DTYPE)


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight [out, in] to ``{"weight": float8_e4m3fn [out, in], "weight_scale": float32 [out, 1]}``."""
    return _rowwise.quantize(weight, FP8_MAX, "fp8", codes)


dequantize = _rowwise.dequantize  # float32(q) · scale, cast to the dtype asked for


def bits_per_weight(group_size: int | None = None, in_features: int = 4096) -> float:
    """8 bits plus one float32 scale per row of ``in_features`` weights (the group size does not apply)."""
    return _rowwise.bits_per_weight(BITS, in_features)


def quantization_config(ignore: Iterable[str] = ()) -> dict:
    """config.json ``quantization_config``: compressed-tensors' ``float-quantized`` schema for these tensors
    (:func:`.compressed.quantization_config`; ``ignore``: the linear modules kept as released)."""
    return compressed.quantization_config("fp8", ignore)
