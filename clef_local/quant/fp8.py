"""fp8: float8_e4m3fn weights with one float32 scale per output row (compressed-tensors' FP8 weight layout).

The rule, its error bound and the stored keys: docs/quantization.md#the-rounding-rules-exactly.
"""

from __future__ import annotations

import torch

from . import _rowwise

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


def quantization_config(group_size: int | None = None) -> dict:
    """config.json ``quantization_config``: a plain description, not compressed-tensors' ``config_groups`` schema.

    The tensors are compressed-tensors' FP8 weight layout (``weight`` e4m3fn + per-channel ``weight_scale``), but
    the config names our scheme (``quant_method`` "clef-local"), so no engine mistakes it for a full
    compressed-tensors or transformers ``fp8`` (block-scaled ``weight_scale_inv``) checkpoint.
    """
    return {
        "quant_method": "clef-local",
        "scheme": "fp8",
        "bits": BITS,
        "fmt": "float8_e4m3fn",
        "granularity": "per_output_channel",
        "weight_dtype": "float8_e4m3fn",
        "scale_dtype": "float32",
        "activation_scheme": "none (weight-only)",
        "tensors": ["weight", "weight_scale"],
    }
