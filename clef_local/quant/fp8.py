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


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight [out, in] to ``{"weight": float8_e4m3fn [out, in], "weight_scale": float32 [out, 1]}``."""
    w, scale = _rowwise.scale(weight, FP8_MAX, "fp8")
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return {"weight": q, "weight_scale": scale}


def dequantize(packed: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float32(q) * scale``, cast to ``dtype``."""
    return _rowwise.dequantize(packed, dtype)


def bits_per_weight(group_size: int | None = None, in_features: int = 4096) -> float:
    """8 bits plus one float32 scale per row of ``in_features`` weights (the group size does not apply)."""
    return _rowwise.bits_per_weight(BITS, in_features)


def quantization_config(ignore: Iterable[str] = ()) -> dict:
    """config.json ``quantization_config``: compressed-tensors' ``float-quantized`` schema for these tensors
    (:func:`.compressed.quantization_config`; ``ignore``: the linear modules kept as released)."""
    return compressed.quantization_config("fp8", ignore)
