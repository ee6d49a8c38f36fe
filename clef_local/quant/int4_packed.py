"""int4 in compressed-tensors' ``pack-quantized`` layout: what vLLM's and SGLang's WNA16 kernels read.

Per quantized linear ``P`` (what compressed-tensors 0.20's ``PackedQuantizationCompressor`` writes, bit for bit):
``P.weight_packed`` int32 [out, in / 8], the codes ``q`` (0..15) of columns 8k..8k+7 in word k, column 8k+j in bits
4j..4j+3 (the same words as the MLX layout's uint32 ``weight``); ``P.weight_scale`` [out, in / g] in the source dtype,
positive; ``P.weight_zero_point`` int32 [ceil(out / 8), in / g], the zero codes packed the same way along the *output*
dimension (rows 8k..8k+7 of a group in word k; a last partial word padded with 0); ``P.weight_shape`` int64 [2], the
weight's [out, in]. ``w = scale · (q - zero)``. compressed-tensors keeps the codes as signed int8 (``q - 8``) and adds
the 8 back when packing, so the stored nibbles are the unsigned codes. A symmetric checkpoint has no zero points: its
zero is 8. The grids: :func:`clef_local.quant.int4.zero_point_values`.
"""

from __future__ import annotations

import torch

from . import compressed, int4

LAYOUTS = ("mlx", "compressed")  # int4's stored layouts: MLX affine (float biases) or compressed-tensors'
DEFAULT_LAYOUT = "mlx"
# integer zero points cannot follow mse's float bias: on the demo model the mlx grid drifted less in this layout
# (docs/benchmarks.md#variants-in-the-ecosystems-tools), so quantize defaults to mlx here
DEFAULT_GRID = "mlx"
KEYS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
SYMMETRIC_ZERO = 8  # a symmetric pack-quantized weight's codes are q - 8 (compressed-tensors' uint4b8)


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes [rows, n] (0..15) → int32 [ceil(rows / 8), n], packed down each column (the zero points' form)."""
    rows = values.shape[0]
    padded = torch.zeros(-(-rows // int4.PACK) * int4.PACK, values.shape[1], dtype=torch.int64)
    padded[:rows] = values.to(torch.int64)
    return int4.pack(padded.T.contiguous()).view(torch.int32).T.contiguous()


def unpack_columns(words: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`pack_columns`: int32 [ceil(rows / 8), n] → int32 codes [rows, n]."""
    return int4.unpack(words.T.contiguous()).T[:rows].to(torch.int32)


def quantize(weight: torch.Tensor, group_size: int = int4.DEFAULT_GROUP_SIZE, grid: str = int4.DEFAULT_GRID
             ) -> dict[str, torch.Tensor]:
    """A 2-D weight [out, in] as the four pack-quantized tensors (``weight_scale`` in ``weight.dtype``)."""
    q, scale, zero = int4.zero_point_values(weight, group_size, grid)
    return {"weight_packed": int4.pack(q).view(torch.int32), "weight_scale": scale,
            "weight_zero_point": pack_columns(zero), "weight_shape": torch.tensor(tuple(weight.shape))}


def join_rows(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of consecutive row blocks of one weight (:func:`quantize` on each) as the whole weight's: every
    block but the last must hold a multiple of 8 rows (8 zero points share a word)."""
    rows = [int(p["weight_shape"][0]) for p in parts]
    if any(r % int4.PACK for r in rows[:-1]):
        raise ValueError(f"pack-quantized row blocks of {rows} rows: all but the last need a multiple of {int4.PACK}")
    whole = {k: torch.cat([p[k] for p in parts]) for k in ("weight_packed", "weight_scale", "weight_zero_point")}
    return {**whole, "weight_shape": torch.tensor([sum(rows), int(parts[0]["weight_shape"][1])])}


def to_affine(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MLX-layout form of pack-quantized tensors, exact: ``weight`` (the same words, viewed as int32),
    ``scales`` and ``biases = -scale · zero`` in float32 (a bf16 / fp16 scale times a code 0..15 is exact in float32,
    and so is ``scale · q + bias = scale · (q - zero)``); what every int4 reader of clef-local takes."""
    words = tensors["weight_packed"]
    scale = tensors["weight_scale"].to(torch.float32)
    stored = tensors.get("weight_zero_point")
    zero = (torch.full_like(scale, SYMMETRIC_ZERO) if stored is None
            else unpack_columns(stored, scale.shape[0]).to(torch.float32))
    return {"weight": words.view(torch.int32), "scales": scale, "biases": -scale * zero}


def dequantize(tensors: dict[str, torch.Tensor], group_size: int = int4.DEFAULT_GROUP_SIZE,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scale · (q - zero)`` per group in float32, cast to ``dtype`` (default: the scale's dtype)."""
    return int4.dequantize(to_affine(tensors), group_size, dtype or tensors["weight_scale"].dtype)


def bits_per_weight(group_size: int = int4.DEFAULT_GROUP_SIZE, scale_bits: int = 16) -> float:
    """Stored bits per weight: 4 + (scale + a 4-bit zero point) / group."""
    return int4.BITS + (scale_bits + int4.BITS) / group_size


def quantization_config(group_size: int = int4.DEFAULT_GROUP_SIZE, ignore: tuple[str, ...] | list[str] = ()
                        ) -> dict:
    """compressed-tensors' ``quantization_config`` of a pack-quantized int4 variant (W4A16, asymmetric, per group)."""
    return compressed.quantization_config("int4", ignore, group_size=group_size)
