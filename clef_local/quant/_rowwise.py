"""What int8 and fp8 share: one float32 scale per output row (``w ≈ q · scale[row]``); they differ only in how
``w / scale`` becomes a code (their ``codes``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def quantize(weight: torch.Tensor, qmax: float, scheme: str, codes: Callable[[torch.Tensor], torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """``{"weight": codes(w / scale), "weight_scale": float32 [out, 1]}`` of a 2-D weight [out, in]."""
    w, row_scale = scale(weight, qmax, scheme)
    return {"weight": codes(w / row_scale), "weight_scale": row_scale}


def dequantize(packed: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float32(q) * weight_scale`` (one scale per row), cast to ``dtype``."""
    return (packed["weight"].to(torch.float32) * packed["weight_scale"].to(torch.float32)).to(dtype)


def bits_per_weight(bits: int, in_features: int) -> float:
    """``bits`` per weight plus one float32 scale per row of ``in_features`` weights."""
    return bits + 32 / in_features


def scale(weight: torch.Tensor, qmax: float, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight in float32 and its per-row scale ``max|w_row| / qmax`` (1 for an all-zero row)."""
    if weight.dim() != 2:
        raise ValueError(f"{scheme} quantizes 2-D weights [out, in], got shape {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    return w, torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
