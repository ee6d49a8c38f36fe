"""The schemes behind one uniform signature: :data:`SCHEMES` and :func:`get` (imported lazily by the package)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import fp8, int4, int4_packed, int8, nf4


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme with a uniform signature.

    ``quantize(weight, group_size, **options)`` -> tensors (int4's options: ``grid``, see :mod:`.int4`, and
    ``layout``, ``mlx`` or ``compressed``, see :mod:`.int4_packed`);
    ``dequantize(tensors, group_size, dtype)`` -> weight; ``bits_per_weight(group_size)``;
    ``quantization_config(group_size, skip_modules=None, **options)`` -> the config.json dict (the same options;
    ``skip_modules``: the linear modules kept as released, which bitsandbytes' and compressed-tensors' configs list;
    int4's readers find its quantized layers by their ``scales`` instead).
    ``default_group_size`` is None where the scheme has no groups (int8, fp8: one scale per row); for nf4 it is the
    bitsandbytes block size, over the flattened weight. ``needs_divisible_input`` says whether the predicate must
    check ``in % group_size`` (only int4 groups run along the input dimension).
    """

    name: str
    bits: int
    default_group_size: int | None
    needs_divisible_input: bool
    quantize: Callable[..., dict[str, torch.Tensor]]
    dequantize: Callable[..., torch.Tensor]
    bits_per_weight: Callable[..., float]
    quantization_config: Callable[..., dict[str, Any]]

    def predicate_group_size(self, group_size: int | None = None) -> int | None:
        """The group size to hand to ``predicate.should_quantize`` for this scheme."""
        return (group_size or self.default_group_size) if self.needs_divisible_input else None

    def top_level_config(self, group_size: int | None = None, **options: Any) -> dict[str, Any]:
        """config.json members written beside ``quantization_config``: for int4 in the MLX layout mlx-lm's
        ``quantization`` block (``{"group_size", "bits": 4, "mode": "affine"}``, which mlx-lm reads before
        ``quantization_config``); none for the other schemes and layouts (mlx-lm would misread pack-quantized
        tensors)."""
        if self.name == "int4" and options.get("layout", int4_packed.DEFAULT_LAYOUT) == "mlx":
            return {"quantization": int4.mlx_quantization(group_size or int4.DEFAULT_GROUP_SIZE)}
        return {}

    def join_rows(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The outputs of :attr:`quantize` on consecutive row blocks of one weight, as one call's: concatenated along
        the rows (the pack-quantized layout's shape and row-packed zero points: :func:`.int4_packed.join_rows`)."""
        if "weight_shape" in parts[0]:
            return int4_packed.join_rows(parts)
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def _int4_quantize(weight: torch.Tensor, group_size: int | None = None, grid: str = int4.DEFAULT_GRID,
                   layout: str = int4_packed.DEFAULT_LAYOUT) -> dict[str, torch.Tensor]:
    if layout not in int4_packed.LAYOUTS:
        raise ValueError(f"int4 layout must be one of {int4_packed.LAYOUTS}, got {layout!r}")
    quantize = int4_packed.quantize if layout == "compressed" else int4.quantize
    return quantize(weight, group_size or int4.DEFAULT_GROUP_SIZE, grid)


def _int4_dequantize(
    packed: dict[str, torch.Tensor], group_size: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    dequantize = int4_packed.dequantize if "weight_packed" in packed else int4.dequantize
    return dequantize(packed, group_size or int4.DEFAULT_GROUP_SIZE, dtype)


def _int4_config(group_size: int | None = None, skip_modules: list[str] | None = None, grid: str = int4.DEFAULT_GRID,
                 layout: str = int4_packed.DEFAULT_LAYOUT) -> dict[str, Any]:
    group = group_size or int4.DEFAULT_GROUP_SIZE
    if layout == "compressed":  # compressed-tensors' own schema; the grid is recorded in the clef_local member
        return int4_packed.quantization_config(group, skip_modules or ())
    return int4.quantization_config(group, grid)


def _nf4_quantize(weight: torch.Tensor, group_size: int | None = None, **options: Any) -> dict[str, torch.Tensor]:
    return nf4.quantize(weight, group_size or nf4.DEFAULT_BLOCKSIZE, **options)


def _nf4_dequantize(
    packed: dict[str, torch.Tensor], group_size: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return nf4.dequantize(packed, dtype)


def _per_channel_dequantize(module: Any) -> Callable[..., torch.Tensor]:
    def dequantize(
        packed: dict[str, torch.Tensor], group_size: int | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return module.dequantize(packed, dtype or torch.float32)

    return dequantize


def _per_channel_quantize(module: Any) -> Callable[..., dict[str, torch.Tensor]]:
    def quantize(weight: torch.Tensor, group_size: int | None = None) -> dict[str, torch.Tensor]:
        return module.quantize(weight)

    return quantize


SCHEMES: dict[str, Scheme] = {
    "int4": Scheme(
        name="int4",
        bits=4,
        default_group_size=int4.DEFAULT_GROUP_SIZE,
        needs_divisible_input=True,
        quantize=_int4_quantize,
        dequantize=_int4_dequantize,
        bits_per_weight=lambda group_size=None: int4.bits_per_weight(group_size or int4.DEFAULT_GROUP_SIZE),
        quantization_config=_int4_config,
    ),
    "int8": Scheme(
        name="int8",
        bits=8,
        default_group_size=None,
        needs_divisible_input=False,
        quantize=_per_channel_quantize(int8),
        dequantize=_per_channel_dequantize(int8),
        bits_per_weight=lambda group_size=None: int8.bits_per_weight(),
        quantization_config=lambda group_size=None, skip_modules=None: int8.quantization_config(skip_modules or ()),
    ),
    "nf4": Scheme(
        name="nf4",
        bits=4,
        default_group_size=nf4.DEFAULT_BLOCKSIZE,
        needs_divisible_input=False,
        quantize=_nf4_quantize,
        dequantize=_nf4_dequantize,
        bits_per_weight=lambda group_size=None, **kw: nf4.bits_per_weight(group_size or nf4.DEFAULT_BLOCKSIZE, **kw),
        quantization_config=lambda group_size=None, **kw: nf4.quantization_config(**kw),
    ),
    "fp8": Scheme(
        name="fp8",
        bits=8,
        default_group_size=None,
        needs_divisible_input=False,
        quantize=_per_channel_quantize(fp8),
        dequantize=_per_channel_dequantize(fp8),
        bits_per_weight=lambda group_size=None: fp8.bits_per_weight(),
        quantization_config=lambda group_size=None, skip_modules=None: fp8.quantization_config(skip_modules or ()),
    ),
}


def get(name: str) -> Scheme:
    """The scheme called ``name`` (int4, int8, nf4, fp8); ValueError naming the known ones otherwise."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}") from None
