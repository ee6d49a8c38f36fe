"""int4: affine 4-bit per group of input columns, stored exactly as MLX stores it (``w = scale·q + bias``).

The rounding rules of both grids (``grid="mse"``, the default, and ``grid="mlx"``, bit for bit ``mx.quantize``),
the packing and how torch's int4 kernels read the same tensors: docs/quantization.md#the-rounding-rules-exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BITS = 4
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64  # mlx-lm's default; a source already on a 32-column grid gets 32 (quantize)
PACK = 8  # 4-bit values per uint32 word
_EPS = 1e-7
_N_BINS = 15.0
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # nibble j of a word sits at bits 4j..4j+3


def check_shape(shape: tuple[int, ...], group_size: int) -> None:
    """Raise ValueError unless ``shape`` is a 2-D [out, in] weight whose ``in`` is a multiple of a valid group."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    if len(shape) != 2:
        raise ValueError(f"int4 quantizes 2-D weights [out, in], got shape {tuple(shape)}")
    if shape[1] % group_size:
        raise ValueError(f"in_features {shape[1]} is not a multiple of group_size {group_size}")


def mlx_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLX's (scale, bias) per group of ``w`` [..., g] (float32), before the cast to the source dtype."""
    w_max = w.amax(dim=-1)
    w_min = w.amin(dim=-1)
    side = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / _N_BINS, min=_EPS)
    scale = torch.where(side, scale, -scale)
    edge = torch.where(side, w_min, w_max)
    q0 = torch.round(edge / scale)
    nonzero = q0 != 0
    scale = torch.where(nonzero, edge / torch.where(nonzero, q0, 1.0), scale)
    bias = torch.where(nonzero, edge, torch.zeros_like(edge))
    return scale, bias


def _assign(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.round((w - bias[..., None]) / scale[..., None]).clamp_(0, _N_BINS)


def _stored(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, bias, squared error per group) of a grid once scale and bias are cast to ``dtype``."""
    scale, bias = scale.to(dtype).to(torch.float32), bias.to(dtype).to(torch.float32)
    scale = torch.where(scale == 0, torch.full_like(scale, -_EPS), scale)  # a cast can flush a tiny scale
    q = _assign(w, scale, bias)
    return q, scale, bias, (q * scale[..., None] + bias[..., None] - w).square_().sum(dim=-1)


def _oriented(lo: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, bias) of the ascending grid (lo, step) with the bias at its edge of larger magnitude (as MLX)."""
    hi = lo + _N_BINS * step
    flip = lo.abs() < hi.abs()
    return torch.where(flip, -step, step), torch.where(flip, hi, lo)


def _least_squares(w: torch.Tensor, q: torch.Tensor, step: torch.Tensor, lo: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (step, lo) minimising ``sum((step·q + lo - w)^2)`` per group; the old pair where that is not > 0."""
    n = w.shape[-1]
    sq, sqq = q.sum(-1), q.square().sum(-1)
    sw, sqw = w.sum(-1), (q * w).sum(-1)
    det = n * sqq - sq * sq
    safe = torch.where(det > 0, det, 1.0)
    fit_step = (n * sqw - sq * sw) / safe
    fit_lo = (sqq * sw - sq * sqw) / safe
    ok = (det > 0) & (fit_step > 0)
    return torch.where(ok, fit_step, step), torch.where(ok, fit_lo, lo)


_MSE_LEVELS = (14.0, 14.5, 15.0, 15.5, 16.0)  # initial grids: the range over n steps, stretched or clipped
GRIDS = ("mse", "mlx")
DEFAULT_GRID = "mse"


def _mse_grid(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, bias) of the stored grid with the least squared error (docs/quantization.md, ``mse``)."""
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    span = (w_max - w_min).clamp(min=_EPS)
    candidates = [mlx_grid(w), _oriented(w_min, span / _N_BINS)]
    for levels in _MSE_LEVELS:
        step, lo = span / levels, w_min
        for _ in range(2):
            step, lo = _least_squares(w, _assign(w, step, lo), step, lo)
        candidates.append(_oriented(lo, step))
    q, scale, bias, error = _stored(w, *candidates[0], dtype)
    for candidate in candidates[1:]:
        q2, scale2, bias2, error2 = _stored(w, *candidate, dtype)
        better = error2 < error  # strict: ties keep the earlier candidate
        q = torch.where(better[..., None], q2, q)
        scale, bias, error = (torch.where(better, new, old) for new, old in
                              ((scale2, scale), (bias2, bias), (error2, error)))
    return q, scale, bias


def quantize_values(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, grid: str = DEFAULT_GRID
                    ) -> tuple[torch.Tensor, ...]:
    """Return (q uint8 [out, in], scales, biases [out, in / g] in ``weight.dtype``) on the ``grid`` rule."""
    check_shape(tuple(weight.shape), group_size)
    if grid not in GRIDS:
        raise ValueError(f"int4 grid must be one of {GRIDS}, got {grid!r}")
    out_f, in_f = weight.shape
    w = weight.detach().to(torch.float32).reshape(out_f, in_f // group_size, group_size)
    if grid == "mlx":
        scale, bias = mlx_grid(w)
        q = _assign(w, scale, bias)
    else:
        q, scale, bias = _mse_grid(w, weight.dtype)
    return q.to(torch.uint8).reshape(out_f, in_f), scale.to(weight.dtype), bias.to(weight.dtype)


def _ascending(scale: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(step > 0, lo) of an MLX-oriented (scale, bias): a negative scale counts down from its bias."""
    return scale.abs(), torch.where(scale < 0, bias + _N_BINS * scale, bias)


def _zero_range(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' min-max rule (its ``calculate_qparams``): the range widened to hold 0, so the zero point
    is a code in 0..15 whatever the signs."""
    lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    step = ((hi - lo) / _N_BINS).clamp(min=_EPS)
    return step, torch.round(-lo / step).clamp_(0, _N_BINS)


def _zero_assign(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round(w / step[..., None] + zero[..., None]).clamp_(0, _N_BINS)


def _zero_fit(w: torch.Tensor, q: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The step minimising ``sum((step·(q - zero) - w)^2)`` per group with the zero fixed; the old one where that is
    not > 0."""
    d = q - zero[..., None]
    den, num = d.square().sum(-1), (d * w).sum(-1)
    fit = num / torch.where(den > 0, den, 1.0)
    return torch.where((den > 0) & (fit > 0), fit, step)


def _mlx_zero_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, step, zero) of MLX's rule: its codes (flipped to ``15 - q`` where its scale is negative) and its bias as
    an integer code (MLX puts the bias on ``q0·scale``). A group all of one sign far from 0 has its zero outside
    0..15: it takes :func:`_zero_range` instead."""
    scale, bias = mlx_grid(w)
    step, lo = _ascending(scale, bias)
    zero = torch.round(-lo / step)
    q = _assign(w, scale, bias)
    q = torch.where(scale[..., None] < 0, _N_BINS - q, q)
    inside = (zero >= 0) & (zero <= _N_BINS)
    if not bool(inside.all()):
        step2, zero2 = _zero_range(w)
        q = torch.where(inside[..., None], q, _zero_assign(w, step2, zero2))
        step, zero = torch.where(inside, step, step2), torch.where(inside, zero, zero2)
    return q, step, zero


def zero_point_values(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, grid: str = DEFAULT_GRID
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w ≈ scale·(q - zero)`` with an integer zero point: (q uint8 [out, in], scale > 0 [out, in / g] in
    ``weight.dtype``, zero uint8 [out, in / g] in 0..15), the asymmetric int4 of compressed-tensors' pack-quantized
    layout (vLLM's and SGLang's WNA16 kernels read the zero point as a 4-bit code, so a float bias cannot go there).

    ``grid="mlx"``: MLX's codes and its bias as the zero code (:func:`_mlx_zero_grid`; the stored values differ from
    the MLX layout's by the bf16 rounding of the bias only). ``grid="mse"``: the candidate with the least squared
    error once its scale is cast to ``weight.dtype``, among MLX's, compressed-tensors' min-max rule and the ``mse``
    grid's stretched ranges with the zero rounded to a code, each step refitted by least squares with its zero fixed.
    """
    check_shape(tuple(weight.shape), group_size)
    if grid not in GRIDS:
        raise ValueError(f"int4 grid must be one of {GRIDS}, got {grid!r}")
    out_f, in_f = weight.shape
    w = weight.detach().to(torch.float32).reshape(out_f, in_f // group_size, group_size)
    q, step, zero = _mlx_zero_grid(w)
    if grid == "mse":
        candidates = [(step, zero), _zero_range(w)]
        w_min, span = w.amin(dim=-1), (w.amax(dim=-1) - w.amin(dim=-1)).clamp(min=_EPS)
        candidates += [(span / levels, torch.round(-w_min / (span / levels)).clamp_(0, _N_BINS))
                       for levels in _MSE_LEVELS]
        error = None
        for index, (step2, zero2) in enumerate(candidates):
            for _ in range(2 if index else 0):  # MLX's own pair stays as it is: the mse grid is never worse
                step2 = _zero_fit(w, _zero_assign(w, step2, zero2), step2, zero2)
            stored = step2.to(weight.dtype).to(torch.float32)
            stored = torch.where(stored > 0, stored, torch.full_like(stored, _EPS))  # a cast can flush a tiny step
            q2 = _zero_assign(w, stored, zero2)
            error2 = ((q2 - zero2[..., None]) * stored[..., None] - w).square_().sum(dim=-1)
            better = error2 < error if error is not None else torch.ones_like(error2, dtype=torch.bool)
            q = torch.where(better[..., None], q2, q)
            step, zero = torch.where(better, stored, step), torch.where(better, zero2, zero)
            error = error2 if error is None else torch.where(better, error2, error)
    return (q.to(torch.uint8).reshape(out_f, in_f), step.to(weight.dtype),
            zero.to(torch.uint8))


def pack(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values [out, in] (0..15, any int dtype) into uint32 [out, in / 8], column 8k+j at bits 4j."""
    if q.shape[-1] % PACK:
        raise ValueError(f"last dimension {q.shape[-1]} is not a multiple of {PACK}")
    nibbles = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // PACK, PACK) & 0xF
    return (nibbles << _SHIFTS.to(q.device)).sum(dim=-1).to(torch.uint32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of uint32 ``words`` as int32 [out, in], through an int32 view: the arithmetic shift's sign
    bits land above the mask (cheaper than widening to int64, and ``dequantize`` runs this on every CPU call)."""
    signed = words.contiguous().view(torch.int32)
    nibbles = (signed[..., None] >> _SHIFTS.to(device=words.device, dtype=torch.int32)) & 0xF
    return nibbles.reshape(*words.shape[:-1], words.shape[-1] * PACK)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: uint32 [out, in / 8] -> uint8 [out, in]."""
    return _nibbles(words).to(torch.uint8)


def quantize(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, grid: str = DEFAULT_GRID
             ) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight [out, in] to ``{"weight": uint32 [out, in/8], "scales", "biases": [out, in/g]}``."""
    q, scales, biases = quantize_values(weight, group_size, grid)
    return {"weight": pack(q), "scales": scales, "biases": biases}


def dequantize(
    packed: dict[str, torch.Tensor], group_size: int = DEFAULT_GROUP_SIZE, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``scales * q + biases`` per group, in float32, cast to ``dtype`` (default: the scales' dtype)."""
    q = _nibbles(packed["weight"]).to(torch.float32)
    out_f, in_f = q.shape
    check_shape((out_f, in_f), group_size)
    scales = packed["scales"].to(torch.float32)[..., None]
    biases = packed["biases"].to(torch.float32)[..., None]
    w = q.reshape(out_f, in_f // group_size, group_size) * scales + biases
    return w.reshape(out_f, in_f).to(dtype or packed["scales"].dtype)


def bits_per_weight(group_size: int = DEFAULT_GROUP_SIZE, scale_bits: int = 16) -> float:
    """Stored bits per weight: 4 + (scale + bias) / group."""
    return BITS + 2 * scale_bits / group_size


def mlx_quantization(group_size: int = DEFAULT_GROUP_SIZE) -> dict:
    """What mlx-lm writes under ``"quantization"`` in config.json for this layout."""
    return {"group_size": group_size, "bits": BITS, "mode": "affine"}


def quantization_config(group_size: int = DEFAULT_GROUP_SIZE, grid: str = DEFAULT_GRID) -> dict:
    """config.json ``quantization_config``: mlx-lm's keys plus the scheme's name (``quant_method`` is ours) and
    how the grids were chosen (``grid``; readers need only the layout)."""
    return {"quant_method": "clef-local", "scheme": "int4", **mlx_quantization(group_size), "layout": "mlx",
            "grid": grid}


class TorchInt4(NamedTuple):
    """Inputs of torch's int4 matmul kernels: packed weight, group size, scales_and_zeros [in/g, out, 2]."""

    weight: torch.Tensor
    group_size: int
    scales_and_zeros: torch.Tensor


def scales_and_zeros(packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch's ``(s, z)`` pairs [in/g, out, 2] for ``w = (q - 8)·s + z``: ``s = scale``, ``z = bias + 8·scale``."""
    scale = packed["scales"].to(torch.float32)
    zero = packed["biases"].to(torch.float32) + 8.0 * scale
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)


# torch's CUDA int4 kernel (tinygemm): the CPU kernel's ``w = (q - 8)·s + z``, bf16 only, its own nibble order
# (docs/quantization.md#the-rounding-rules-exactly).
TINYGEMM_CAPABILITY = (8, 0)
TINYGEMM_DTYPE = torch.bfloat16


def tinygemm_inner_k_tiles(in_features: int) -> int | None:
    """The largest ``inner_k_tiles`` (8, 4 or 2) whose tile width 16 · tiles divides ``in_features``."""
    return next((tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0), None)


def tinygemm_uint8(q: torch.Tensor) -> torch.Tensor:
    """4-bit values [out, in] (0..15, any int dtype) → uint8 [out, in / 2], column 2j high nibble, 2j + 1 low."""
    q = q.to(torch.uint8)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()


def tinygemm_unsupported(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                         group_size: int) -> str:
    """Why torch's CUDA int4 kernel cannot serve this layer ("" when it can)."""
    if device.type != "cuda":
        return f"tinygemm is a CUDA kernel, the layer is on {device.type}"
    if torch.version.hip is not None:
        return "tinygemm is not built for ROCm"
    capability = torch.cuda.get_device_capability(device)
    if capability < TINYGEMM_CAPABILITY:
        return f"tinygemm needs sm_80+, this GPU is sm_{capability[0]}{capability[1]}"
    if dtype != TINYGEMM_DTYPE:
        return f"{dtype} activations (tinygemm takes bfloat16 only)"
    if out_features % 8:
        return f"out_features {out_features} is not a multiple of 8 (tinygemm)"
    if tinygemm_inner_k_tiles(in_features) is None or group_size not in (32, 64, 128, 256):
        return f"in_features {in_features} / group size {group_size} do not fit tinygemm's tiles"
    return ""


def to_tinygemm(packed: dict[str, torch.Tensor], group_size: int = DEFAULT_GROUP_SIZE,
                dtype: torch.dtype = TINYGEMM_DTYPE) -> TorchInt4:
    """Repack MLX-layout int4 (on a CUDA device) into tinygemm's tiled format, exactly.

    The stored uint32 words are read through an int32 view (same bits) because CUDA has little uint32 arithmetic.
    """
    words = packed["weight"]
    q = unpack(words.view(torch.int32) if words.dtype == torch.uint32 else words)
    check_shape(tuple(q.shape), group_size)
    tiles = tinygemm_inner_k_tiles(q.shape[1])
    if tiles is None:
        raise ValueError(f"tinygemm needs in_features % 32 == 0, got {q.shape[1]}")
    weight = torch.ops.aten._convert_weight_to_int4pack(tinygemm_uint8(q), tiles)
    return TorchInt4(weight, group_size, scales_and_zeros(packed, dtype))


def tinygemm_matmul(x: torch.Tensor, repacked: TorchInt4) -> torch.Tensor:
    """``x @ W.T`` with torch's CUDA int4 kernel; ``x`` [..., in] is cast to bfloat16 (the output is bfloat16)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(TINYGEMM_DTYPE).contiguous()
    y = torch.ops.aten._weight_int4pack_mm(x2, repacked.weight, repacked.group_size, repacked.scales_and_zeros)
    return y.reshape(*lead, y.shape[-1])
