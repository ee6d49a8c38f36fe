"""A release's backbone tensors for the MLX backend: read with numpy (no torch), quantized layers as MLX arrays.

BF16 and F8_E4M3 bit patterns are decoded here exactly. int4 is taken as stored (compressed-tensors' pack-quantized
int4 as the same words with ``biases = -scale · zero``, exact in float32); int8 maps exactly onto MLX's 8-bit
affine arrays with the row scale applied to the output (folding it into MLX's scales is not exact); nf4 and fp8 are
dequantized with a warning (docs/hardware.md#mlx, docs/format.md §6).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clef_local.errors import ReleaseError
from clef_local.formats.quant_plan import MIXED, LayerFormat, layer_index, mixed_plan
from clef_local.formats.safetensors import DTYPES, read_arrays, read_header
from clef_local.formats.variant import variant_format
from clef_local.quant import registry

log = logging.getLogger(__name__)

FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3"})
SCHEMES = tuple(registry.SCHEMES)
DEQUANTIZED = frozenset(registry.names_where(lambda row: not row.mlx_quantized))  # MLX has no kernel: dequantized
INT8_OFFSET = 128
MLX_GROUP_SIZES = (128, 64, 32)  # largest first: the int8 mapping takes the largest that divides in_features


@dataclass(frozen=True)
class Stored:
    """One tensor as stored: its raw array (BF16/F8 as bit patterns) and its safetensors dtype name."""

    array: np.ndarray
    dtype: str

    def float32(self) -> np.ndarray:
        """The values in float32 (exact for every floating dtype a release holds except F64)."""
        if self.dtype == "BF16":
            return (self.array.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "F8_E4M3":
            return E4M3_TABLE[self.array]
        if self.dtype not in FLOATING:
            what = "MLX backend cannot decode it" if DTYPES[self.dtype].floating else "expected a floating tensor"
            raise ReleaseError(f"a {self.dtype} tensor has no float value ({what})")
        return self.array.astype(np.float32)


def _e4m3fn_table() -> np.ndarray:
    """float32 value of every float8_e4m3fn bit pattern: sign, 4 exponent bits (bias 7), 3 mantissa bits, no
    infinities, S.1111.111 is NaN."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, value)
    return (sign * value).astype(np.float32)


E4M3_TABLE = _e4m3fn_table()


def read_safetensors(file: Path) -> dict[str, Stored]:
    """Every tensor of a safetensors file as a numpy array over a read-only memory map (no copy, no torch), after
    :func:`clef_local.formats.safetensors.read_header` has checked the header against the file."""
    header = read_header(file)
    return {name: Stored(array, header[name].dtype) for name, array in read_arrays(file, header=header).items()}


def variant_scheme(config: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """(scheme, group size) of a variant's ``config.json`` (:func:`clef_local.formats.variant.variant_format`);
    (None, None) for a full-precision release, (``mixed``, None) for a mixed-precision one (its per-layer plan:
    :func:`clef_local.formats.quant_plan.mixed_plan`)."""
    fmt = variant_format(config)
    if fmt is None:
        return None, None
    if fmt.scheme == MIXED:
        for layer in (mixed_plan(config) or {}).values():
            if _mlx_grouped(layer.scheme) and layer.group_size not in MLX_GROUP_SIZES:
                raise ReleaseError(f"config.json: a mixed plan's {layer.scheme} group_size {layer.group_size!r} is "
                                   f"not one MLX supports ({MLX_GROUP_SIZES})")
        return MIXED, None
    if _mlx_grouped(fmt.scheme) and fmt.group_size not in MLX_GROUP_SIZES:
        raise ReleaseError(f"config.json: {fmt.scheme} group_size {fmt.group_size!r} is not one MLX supports "
                           f"({MLX_GROUP_SIZES})")
    return fmt.scheme, fmt.group_size


def _mlx_grouped(scheme: str) -> bool:
    """Whether ``scheme``'s layers become MLX quantized layers of its own groups (int4), which MLX must support."""
    row = registry.SCHEMES.get(scheme)
    return row is not None and row.mlx_quantized and row.needs_divisible_input


@dataclass
class QuantizedLayer:
    """A linear layer in MLX's affine layout: ``W = scales · q + biases`` per group (times ``row_scale`` per
    output row when given); ``weight`` is uint32 [out, in · bits / 32]."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    group_size: int
    bits: int
    row_scale: np.ndarray | None = None  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * 32 // self.bits


def int8_to_mlx(q: np.ndarray, scale: np.ndarray) -> QuantizedLayer:
    """int8 ``q`` [out, in] and float32 ``scale`` [out, 1] as MLX 8-bit affine arrays with unit scales, biases
    -128 and the scale per row (see the module docstring for why this, and not folded scales, is exact)."""
    out_f, in_f = q.shape
    group = next((g for g in MLX_GROUP_SIZES if in_f % g == 0), None)
    if group is None:
        raise ReleaseError(f"int8 layer with in_features {in_f}: MLX needs a multiple of 32")
    if q.dtype != np.int8 or scale.shape != (out_f, 1):
        raise ReleaseError(f"int8 layer: weight {q.dtype} {list(q.shape)} / weight_scale {list(scale.shape)}; "
                           f"expected int8 [out, in] and float32 [out, 1]")
    unsigned = (q.astype(np.int16) + INT8_OFFSET).astype(np.uint8)
    words = np.ascontiguousarray(unsigned).view("<u4")  # byte j of a little-endian word = column 4k+j
    groups = in_f // group
    return QuantizedLayer(weight=words, scales=np.ones((out_f, groups), np.float32),
                          biases=np.full((out_f, groups), -INT8_OFFSET, np.float32), group_size=group, bits=8,
                          row_scale=scale.reshape(-1).astype(np.float32))


def packed_int4_to_mlx(tensors: Mapping[str, Stored], group: int) -> QuantizedLayer:
    """compressed-tensors' pack-quantized int4 (:mod:`clef_local.quant.int4_packed`) as MLX affine arrays: the same
    words, the scales widened to float32 and ``biases = -scale · zero`` (a zero point is a 4-bit code packed 8 rows
    per int32 word down each column; 8 for a symmetric checkpoint, which stores none)."""
    words = np.ascontiguousarray(tensors["weight_packed"].array).view("<u4")
    scales = tensors["weight_scale"].float32()
    out_f = words.shape[0]
    if "weight_zero_point" in tensors:
        packed = np.ascontiguousarray(tensors["weight_zero_point"].array).view("<u4")  # [ceil(out / 8), groups]
        shifts = np.arange(0, 32, 4, dtype=np.uint32)
        zero = ((packed[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, packed.shape[1])[:out_f]
    else:
        zero = np.full(scales.shape, 8, np.uint32)
    return QuantizedLayer(weight=words, scales=scales, biases=-scales * zero.astype(np.float32), group_size=group,
                          bits=4)


def int4_dequantize(layer: QuantizedLayer) -> np.ndarray:
    """``scales · q + biases`` per group of a 4-bit layer, float32 [out, in] (quant.int4's math, in numpy)."""
    out_f, in_f = layer.shape
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    q = ((layer.weight[..., None] >> shifts) & 0xF).reshape(out_f, in_f // layer.group_size, layer.group_size)
    w = q.astype(np.float32) * layer.scales[..., None] + layer.biases[..., None]
    return w.reshape(out_f, in_f)


# mlx-lm's conversions quantize the embeddings too; the backend gathers rows from a float matrix
EMBEDDINGS = ("embed_tokens", "lm_head")


def fp8_dequantize(q: Stored, scale: np.ndarray) -> np.ndarray:
    """``float32(e4m3fn q) · scale`` (quant.fp8's math, in numpy)."""
    return q.float32() * scale.astype(np.float32)


def nf4_dequantize(tensors: Mapping[str, Stored]) -> np.ndarray:
    """``NF4_CODE[q] · absmax[block]`` reshaped to the stored shape (quant.nf4's math, in numpy); ``tensors``
    are the layer's ``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__nf4``
    (and the nested ones with double quantization)."""
    blob = next((t for k, t in tensors.items() if k.startswith("weight.quant_state.")), None)
    if blob is None:
        raise ReleaseError(f"nf4 layer without a quant_state blob (has {', '.join(sorted(tensors))})")
    meta = json.loads(bytes(blob.array.tolist()).decode("utf-8"))
    shape = tuple(meta["shape"])
    n = int(np.prod(shape))
    data = tensors["weight"].array.reshape(-1).view(np.uint8)
    q = np.stack([data >> 4, data & 0xF], axis=-1).reshape(-1)[:n]
    code = tensors["weight.quant_map"].float32()
    absmax_stored = tensors["weight.absmax"]
    if "weight.nested_absmax" in tensors:
        nested_code = tensors["weight.nested_quant_map"].float32()
        nested = tensors["weight.nested_absmax"].float32()
        index = np.arange(absmax_stored.array.size) // meta["nested_blocksize"]
        absmax = nested_code[absmax_stored.array.reshape(-1).astype(np.int64)] * nested[index]
        absmax = absmax + np.float32(meta["nested_offset"])
    else:
        absmax = absmax_stored.float32().reshape(-1)
    block = np.arange(n) // meta["blocksize"]
    return (code[q] * absmax[block]).reshape(shape).astype(np.float32)


PACKED = ".weight_packed"  # int4 in compressed-tensors' pack-quantized layout


def _quantized_prefixes(names: Iterable[str], scheme: str) -> list[str]:
    row = registry.get(scheme)
    markers = tuple(m for m in (row.marker, row.packed_marker) if m is not None)
    return sorted(n[: -len(m)] for n in names for m in markers if n.endswith(m))


def _planned_layers(names: Iterable[str], plan: Mapping[int, LayerFormat]) -> dict[str, LayerFormat]:
    """{module path: its layer's format} for every module of a mixed variant that holds a scheme's extra tensor."""
    found: dict[str, LayerFormat] = {}
    markers = {row.marker for row in registry.SCHEMES.values()}
    for name in names:
        for marker in markers:
            if name.endswith(marker):
                prefix = name[: -len(marker)]
                index = layer_index(prefix)
                fmt = plan.get(index) if index is not None else None
                if fmt is None or fmt.scheme not in SCHEMES or registry.get(fmt.scheme).marker != marker:
                    raise ReleaseError(f"{name}: its layer's entry in config.json's mixed plan is "
                                       f"{fmt.label if fmt else 'missing'}, which stores no {marker}")
                found[prefix] = fmt
    return found


def _layer(prefix: str, tensors: Mapping[str, Stored], scheme: str, group: int | None) -> QuantizedLayer | Stored:
    """The MLX form of one quantized layer's stored tensors: a QuantizedLayer (int4, int8) or a float32 weight, by
    the loader the scheme's row names."""
    loader: Callable[[str, Mapping[str, Stored], int | None], QuantizedLayer | Stored] = globals()[
        registry.get(scheme).mlx_loader]
    return loader(prefix, tensors, group)


def int4_layer(prefix: str, tensors: Mapping[str, Stored], group: int | None) -> QuantizedLayer:
    """An int4 layer, in the MLX layout or compressed-tensors' pack-quantized one, as a QuantizedLayer."""
    if "weight_packed" in tensors:
        packed, scale = tensors["weight_packed"], tensors["weight_scale"]
        if packed.dtype != "I32" or group is None or scale.array.shape != (packed.array.shape[0],
                                                                          packed.array.shape[1] * 8 // group):
            raise ReleaseError(f"{prefix}: pack-quantized int4 weight_packed {packed.dtype} "
                               f"{list(packed.array.shape)} / weight_scale {list(scale.array.shape)} do not fit "
                               f"group_size {group} (expected I32 [out, in / 8] and [out, in / {group}])")
        return packed_int4_to_mlx(tensors, group)
    weight = tensors["weight"]
    if weight.dtype != "U32" or group is None:
        raise ReleaseError(f"{prefix}.weight is {weight.dtype}; an int4 layer stores uint32 (MLX layout)")
    scales, biases = tensors["scales"], tensors["biases"]
    in_f = weight.array.shape[1] * 8
    if scales.array.shape != (weight.array.shape[0], in_f // group) or biases.array.shape != scales.array.shape:
        raise ReleaseError(f"{prefix}: int4 scales {list(scales.array.shape)} do not match weight "
                           f"{list(weight.array.shape)} with group_size {group}")
    return QuantizedLayer(weight=np.ascontiguousarray(weight.array), scales=scales.float32(),
                          biases=biases.float32(), group_size=group, bits=4)


def int8_layer(prefix: str, tensors: Mapping[str, Stored], group: int | None) -> QuantizedLayer:
    """An int8 layer as MLX 8-bit affine arrays (:func:`int8_to_mlx`)."""
    weight = tensors["weight"]
    if weight.dtype != "I8":
        raise ReleaseError(f"{prefix}.weight is {weight.dtype}; an int8 layer stores I8")
    return int8_to_mlx(weight.array, tensors["weight_scale"].float32())


def fp8_layer(prefix: str, tensors: Mapping[str, Stored], group: int | None) -> Stored:
    """An fp8 layer's weight, dequantized to float32 (MLX has no fp8 kernel)."""
    weight = tensors["weight"]
    if weight.dtype != "F8_E4M3":
        raise ReleaseError(f"{prefix}.weight is {weight.dtype}; an fp8 layer stores F8_E4M3")
    return Stored(fp8_dequantize(weight, tensors["weight_scale"].float32()), "F32")


def nf4_layer(prefix: str, tensors: Mapping[str, Stored], group: int | None) -> Stored:
    """An nf4 layer's weight, dequantized to float32 (MLX has no nf4 kernel)."""
    return Stored(nf4_dequantize(tensors), "F32")


def load_backbone_tensors(files: Sequence[Path], scheme: str | None, group: int | None,
                          plan: Mapping[int, LayerFormat] | None = None
                          ) -> tuple[dict[str, Stored], dict[str, QuantizedLayer]]:
    """All backbone tensors by their release names, with each quantized layer's tensors replaced: int4/int8 layers
    go to the second dict ({module path: QuantizedLayer}), nf4/fp8 layers come back as float32 ``.weight``s. A
    ``mixed`` variant takes each module's scheme and group from its layer's entry in ``plan``."""
    plain: dict[str, Stored] = {}
    for file in files:
        plain.update(read_safetensors(file))
    quantized: dict[str, QuantizedLayer] = {}
    if scheme is None:
        return plain, quantized
    if scheme == MIXED:
        if plan is None:
            raise ReleaseError("config.json names scheme mixed but has no per-layer plan")
        formats = _planned_layers(list(plain), plan)
    else:
        formats = {prefix: LayerFormat(scheme, group) for prefix in _quantized_prefixes(plain, scheme)}
    if not formats:
        raise ReleaseError(f"config.json names scheme {scheme} but no tensor carries a quantized layer's "
                           f"{'extra tensors' if scheme == MIXED else registry.get(scheme).marker}")
    for prefix, fmt in formats.items():
        start = prefix + "."
        names = [n for n in plain if n.startswith(start) and n != start + "bias"]
        layer = _layer(prefix, {n[len(start):]: plain.pop(n) for n in names}, fmt.scheme, fmt.group_size)
        if isinstance(layer, QuantizedLayer) and prefix.rpartition(".")[2] in EMBEDDINGS:
            log.info("dequantizing the int4 embedding %s %s to full precision", prefix, list(layer.shape))
            plain[start + "weight"] = Stored(int4_dequantize(layer), "F32")
        elif isinstance(layer, QuantizedLayer):
            quantized[prefix] = layer
        else:
            plain[start + "weight"] = layer
    dequantized = sum(fmt.scheme in DEQUANTIZED for fmt in formats.values())
    if dequantized and scheme == MIXED:
        log.warning("MLX has no nf4 / fp8 kernel: %d layers of this mixed variant were dequantized to full precision",
                    dequantized)
    elif scheme in DEQUANTIZED:
        log.warning("MLX has no %s kernel: %d layers were dequantized to full precision (memory as an unquantized "
                    "model; the decisions are the %s variant's)", scheme, len(formats), scheme)
    return plain, quantized
