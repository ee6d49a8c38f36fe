"""int4: affine 4-bit per group of input columns, stored exactly as MLX stores it (``w = scale·q + bias``).

The rounding rules of both grids (``grid="mse"``, the default, and ``grid="mlx"``, bit for bit ``mx.quantize``),
the packing and how torch's int4 kernels read the same tensors: docs/quantization.md#the-rounding-rules-exactly.

How the grids run (:func:`_by_blocks`): on the CPU in blocks of :data:`BLOCK_ELEMENTS` values (whole groups) on a
pool of ``torch.get_num_threads()`` threads. Every group goes through the same elementwise ops and the same
reductions over its own g values whatever block it falls in, so the bytes are those of one whole-tensor call
(tests/test_int4_grid_speed.py keeps that call as its oracle).

A weight on a CUDA device runs in one call on the device. The bytes can differ from the CPU's there: CUDA sums a
group in another order, and divides by a Python number (``span / 15``) as a multiplication by its reciprocal (1 ulp
off at times), so a least-squares fit, a candidate's error or a step can differ in its last bits; where two
candidates nearly tie or a value sits at a rounding midpoint, another grid or code wins. Rare: a test on a GPU
bounds the fraction of differing codes and the squared error.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    return _mlx_pair(w.amin(dim=-1), w.amax(dim=-1))


def _mlx_pair(w_min: torch.Tensor, w_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mlx_grid` from each group's minimum and maximum."""
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
    """``clamp(rint((w - bias) / scale), 0, 15)`` per group, as float32 codes (one new tensor, the rest in place)."""
    return (w - bias[..., None]).div_(scale[..., None]).round_().clamp_(0, _N_BINS)


def _stored(scale: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, bias) as stored in ``dtype``, back in float32."""
    scale, bias = scale.to(dtype).to(torch.float32), bias.to(dtype).to(torch.float32)
    return torch.where(scale == 0, torch.full_like(scale, -_EPS), scale), bias  # a cast can flush a tiny scale


def _error(w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``Σ (scale·q + bias − w)²`` per group with q = :func:`_assign` (the products, sums and square each rounded
    once, in this order)."""
    return _assign(w, scale, bias).mul_(scale[..., None]).add_(bias[..., None]).sub_(w).square_().sum(dim=-1)


def _oriented(lo: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, bias) of the ascending grid (lo, step) with the bias at its edge of larger magnitude (as MLX)."""
    hi = lo + _N_BINS * step
    flip = lo.abs() < hi.abs()
    return torch.where(flip, -step, step), torch.where(flip, hi, lo)


def _least_squares(w: torch.Tensor, sw: torch.Tensor, q: torch.Tensor, step: torch.Tensor, lo: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (step, lo) minimising ``sum((step·q + lo - w)^2)`` per group (``sw``: ``w.sum(-1)``); the old pair where
    that is not > 0. Squares ``q`` in place."""
    n = w.shape[-1]
    sq, sqw = q.sum(-1), (q * w).sum(-1)
    sqq = q.square_().sum(-1)
    det = n * sqq - sq * sq
    safe = torch.where(det > 0, det, 1.0)
    fit_step = (n * sqw - sq * sw) / safe
    fit_lo = (sqq * sw - sq * sqw) / safe
    ok = (det > 0) & (fit_step > 0)
    return torch.where(ok, fit_step, step), torch.where(ok, fit_lo, lo)


_MSE_LEVELS = (14.0, 14.5, 15.0, 15.5, 16.0)  # initial grids: the range over n steps, stretched or clipped
GRIDS = ("mse", "mlx")
DEFAULT_GRID = "mse"
# CPU blocks of groups (_by_blocks): float32 values per block. A block's temporaries (a few times its 2 MB) stay in
# cache instead of walking the whole tensor's through memory at every op; much smaller blocks lose to torch's per-op
# overhead (measured on a 2-core EPYC: 2^17 to 2^21 within ~30% of each other, 2^19 fastest; benchmarks/grid_speed.py)
BLOCK_ELEMENTS = 1 << 19
Block = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _mse_grid(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, bias) of the stored grid with the least squared error (docs/quantization.md, ``mse``)."""
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    span = (w_max - w_min).clamp_(min=_EPS)
    sw = w.sum(-1)
    candidates = [_mlx_pair(w_min, w_max), _oriented(w_min, span / _N_BINS)]
    for levels in _MSE_LEVELS:
        step, lo = span / levels, w_min
        for _ in range(2):
            step, lo = _least_squares(w, sw, _assign(w, step, lo), step, lo)
        candidates.append(_oriented(lo, step))
    scale, bias = _stored(*candidates[0], dtype)
    error = _error(w, scale, bias)
    for candidate in candidates[1:]:
        scale2, bias2 = _stored(*candidate, dtype)
        error2 = _error(w, scale2, bias2)
        better = error2 < error  # strict: ties keep the earlier candidate
        scale, bias, error = (torch.where(better, new, old) for new, old in
                              ((scale2, scale), (bias2, bias), (error2, error)))
    return _assign(w, scale, bias), scale, bias  # the winner's codes: the same elementwise ops on the same values


def _by_blocks(weight: torch.Tensor, group_size: int, block: Block, dtypes: tuple[torch.dtype, torch.dtype]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block`` (float32 groups [n, g] → float32 codes [n, g] and two [n] per-group tensors) over every group of
    ``weight``, cast to (uint8, ``dtypes[0]``, ``dtypes[1]``) and shaped [out, in], [out, in / g] twice.

    Off the CPU (a CUDA weight) one call takes every group. On the CPU the groups run in blocks of
    :data:`BLOCK_ELEMENTS` values on a pool of ``torch.get_num_threads()`` threads, each with one intra-op thread (the
    setting is put back after): every group's values go through the same elementwise ops and the same per-group
    reductions whatever its block, so the bytes are the one call's (tests/test_int4_grid_speed.py). A weight of one
    block (the export's row chunks, clef_local.export.shards.CHUNK_ELEMENTS) runs inline on torch's own intra-op
    threads, as fast on the 2-core machine measured.
    """
    out_f, in_f = weight.shape
    per_row = in_f // group_size
    groups = weight.detach().reshape(-1, group_size)
    if weight.device.type != "cpu":
        q, a, b = block(groups.to(torch.float32))
        return (q.to(torch.uint8).reshape(out_f, in_f), a.to(dtypes[0]).reshape(out_f, per_row),
                b.to(dtypes[1]).reshape(out_f, per_row))
    q_out = torch.empty(groups.shape, dtype=torch.uint8)
    a_out, b_out = (torch.empty(groups.shape[0], dtype=dtype) for dtype in dtypes)
    step = max(1, BLOCK_ELEMENTS // group_size)

    def run(start: int) -> None:
        stop = min(start + step, groups.shape[0])
        q, a, b = block(groups[start:stop].to(torch.float32))
        q_out[start:stop].copy_(q)  # copy_ casts as .to() does
        a_out[start:stop].copy_(a)
        b_out[start:stop].copy_(b)

    starts = range(0, groups.shape[0], step)
    workers = min(len(starts), torch.get_num_threads())
    if workers <= 1:
        for start in starts:
            run(start)
    else:
        threads = torch.get_num_threads()
        try:
            # one intra-op thread per worker: the pool is the parallelism (torch's setting is per process, so the
            # caller's is restored once the pool is done)
            with ThreadPoolExecutor(workers, thread_name_prefix="clef-int4", initializer=torch.set_num_threads,
                                    initargs=(1,)) as pool:
                for _ in pool.map(run, starts):
                    pass
        finally:
            torch.set_num_threads(threads)
    return q_out.reshape(out_f, in_f), a_out.reshape(out_f, per_row), b_out.reshape(out_f, per_row)


def _check_grid(grid: str) -> None:
    if grid not in GRIDS:
        raise ValueError(f"int4 grid must be one of {GRIDS}, got {grid!r}")


def quantize_values(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, grid: str = DEFAULT_GRID
                    ) -> tuple[torch.Tensor, ...]:
    """Return (q uint8 [out, in], scales, biases [out, in / g] in ``weight.dtype``) on the ``grid`` rule.

    On the CPU in row blocks on every core (:func:`_by_blocks`), on a CUDA device in one call: docs/quantization.md
    #the-rounding-rules-exactly says what may differ there."""
    check_shape(tuple(weight.shape), group_size)
    _check_grid(grid)

    def block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if grid == "mse":
            return _mse_grid(w, weight.dtype)
        scale, bias = mlx_grid(w)
        return _assign(w, scale, bias), scale, bias

    return _by_blocks(weight, group_size, block, (weight.dtype, weight.dtype))


def _ascending(scale: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(step > 0, lo) of an MLX-oriented (scale, bias): a negative scale counts down from its bias."""
    return scale.abs(), torch.where(scale < 0, bias + _N_BINS * scale, bias)


def _zero_range(w_min: torch.Tensor, w_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' min-max rule (its ``calculate_qparams``) from each group's minimum and maximum: the range
    widened to hold 0, so the zero point is a code in 0..15 whatever the signs."""
    lo, hi = w_min.clamp(max=0), w_max.clamp(min=0)
    step = ((hi - lo) / _N_BINS).clamp(min=_EPS)
    return step, torch.round(-lo / step).clamp_(0, _N_BINS)


def _zero_assign(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``clamp(rint(w / step + zero), 0, 15)`` per group, as float32 codes."""
    return (w / step[..., None]).add_(zero[..., None]).round_().clamp_(0, _N_BINS)


def _zero_fit(w: torch.Tensor, q: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The step minimising ``sum((step·(q - zero) - w)^2)`` per group with the zero fixed; the old one where that is
    not > 0. Overwrites ``q``."""
    d = q.sub_(zero[..., None])
    num = (d * w).sum(-1)
    den = d.square_().sum(-1)
    fit = num / torch.where(den > 0, den, 1.0)
    return torch.where((den > 0) & (fit > 0), fit, step)


def _mlx_zero_pair(w_min: torch.Tensor, w_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(step, zero, inside) of MLX's rule: its scale made positive and its bias as an integer code (MLX puts the bias
    on ``q0·scale``); ``inside`` where that code is in 0..15. Elsewhere (a group all of one sign far from 0)
    :func:`_zero_range`'s pair replaces it."""
    step, lo = _ascending(*_mlx_pair(w_min, w_max))
    zero = torch.round(-lo / step)
    inside = (zero >= 0) & (zero <= _N_BINS)
    if not bool(inside.all()):
        step2, zero2 = _zero_range(w_min, w_max)
        step, zero = torch.where(inside, step, step2), torch.where(inside, zero, zero2)
    return step, zero, inside


def _mlx_zero_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, step, zero) of MLX's rule: its codes (flipped to ``15 - q`` where its scale is negative) and its bias as
    an integer code (:func:`_mlx_zero_pair`). A group all of one sign far from 0 has its zero outside 0..15: it takes
    :func:`_zero_range` instead."""
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    scale, bias = _mlx_pair(w_min, w_max)
    step, zero, inside = _mlx_zero_pair(w_min, w_max)
    q = _assign(w, scale, bias)
    q = torch.where(scale[..., None] < 0, _N_BINS - q, q)
    if not bool(inside.all()):
        q = torch.where(inside[..., None], q, _zero_assign(w, step, zero))
    return q, step, zero


def _zero_mse_grid(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, zero) of the zero-point candidate with the least squared error (:func:`zero_point_values`)."""
    w_min, w_max = w.amin(dim=-1), w.amax(dim=-1)
    span = (w_max - w_min).clamp_(min=_EPS)
    step, zero, _ = _mlx_zero_pair(w_min, w_max)
    candidates = [(step, zero), _zero_range(w_min, w_max)]
    candidates += [(span / levels, torch.round(-w_min / (span / levels)).clamp_(0, _N_BINS))
                   for levels in _MSE_LEVELS]
    error = None
    for index, (step2, zero2) in enumerate(candidates):
        for _ in range(2 if index else 0):  # MLX's own pair stays as it is: the mse grid is never worse
            step2 = _zero_fit(w, _zero_assign(w, step2, zero2), step2, zero2)
        stored = step2.to(dtype).to(torch.float32)
        stored = torch.where(stored > 0, stored, torch.full_like(stored, _EPS))  # a cast can flush a tiny step
        error2 = _zero_assign(w, stored, zero2).sub_(zero2[..., None]).mul_(stored[..., None]).sub_(w)
        error2 = error2.square_().sum(dim=-1)
        if error is None:
            step, zero, error = stored, zero2, error2
        else:
            better = error2 < error  # strict: ties keep the earlier candidate
            step, zero, error = (torch.where(better, new, old) for new, old in
                                 ((stored, step), (zero2, zero), (error2, error)))
    return _zero_assign(w, step, zero), step, zero  # the winner's codes: the same ops on the same values


def zero_point_values(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, grid: str = DEFAULT_GRID
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w ≈ scale·(q - zero)`` with an integer zero point: (q uint8 [out, in], scale > 0 [out, in / g] in
    ``weight.dtype``, zero uint8 [out, in / g] in 0..15), the asymmetric int4 of compressed-tensors' pack-quantized
    layout (vLLM's and SGLang's WNA16 kernels read the zero point as a 4-bit code, so a float bias cannot go there).

    ``grid="mlx"``: MLX's codes and its bias as the zero code (:func:`_mlx_zero_grid`; the stored values differ from
    the MLX layout's by the bf16 rounding of the bias only). ``grid="mse"``: the candidate with the least squared
    error once its scale is cast to ``weight.dtype``, among MLX's, compressed-tensors' min-max rule and the ``mse``
    grid's stretched ranges with the zero rounded to a code, each step refitted by least squares with its zero fixed.
    Row blocks and devices as :func:`quantize_values`.
    """
    check_shape(tuple(weight.shape), group_size)
    _check_grid(grid)

    def block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _zero_mse_grid(w, weight.dtype) if grid == "mse" else _mlx_zero_grid(w)

    return _by_blocks(weight, group_size, block, (weight.dtype, torch.uint8))


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
