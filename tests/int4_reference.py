"""Test oracle: int4's grids as whole-tensor torch ops, copied from clef_local/quant/int4.py as of commit 3e3a44d,
before they ran in blocks on a thread pool; the blocked code must write the same bytes (tests/test_int4_grid_speed.py).
"""

from __future__ import annotations

import torch

_EPS = 1e-7
_N_BINS = 15.0
_MSE_LEVELS = (14.0, 14.5, 15.0, 15.5, 16.0)


def mlx_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    scale, bias = scale.to(dtype).to(torch.float32), bias.to(dtype).to(torch.float32)
    scale = torch.where(scale == 0, torch.full_like(scale, -_EPS), scale)
    q = _assign(w, scale, bias)
    return q, scale, bias, (q * scale[..., None] + bias[..., None] - w).square_().sum(dim=-1)


def _oriented(lo: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = lo + _N_BINS * step
    flip = lo.abs() < hi.abs()
    return torch.where(flip, -step, step), torch.where(flip, hi, lo)


def _least_squares(w: torch.Tensor, q: torch.Tensor, step: torch.Tensor, lo: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    n = w.shape[-1]
    sq, sqq = q.sum(-1), q.square().sum(-1)
    sw, sqw = w.sum(-1), (q * w).sum(-1)
    det = n * sqq - sq * sq
    safe = torch.where(det > 0, det, 1.0)
    fit_step = (n * sqw - sq * sw) / safe
    fit_lo = (sqq * sw - sq * sqw) / safe
    ok = (det > 0) & (fit_step > 0)
    return torch.where(ok, fit_step, step), torch.where(ok, fit_lo, lo)


def _mse_grid(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        better = error2 < error
        q = torch.where(better[..., None], q2, q)
        scale, bias, error = (torch.where(better, new, old) for new, old in
                              ((scale2, scale), (bias2, bias), (error2, error)))
    return q, scale, bias


def quantize_values(weight: torch.Tensor, group_size: int, grid: str = "mse") -> tuple[torch.Tensor, ...]:
    """(q uint8 [out, in], scales, biases) as int4.quantize_values wrote them before the row blocks."""
    out_f, in_f = weight.shape
    w = weight.detach().to(torch.float32).reshape(out_f, in_f // group_size, group_size)
    if grid == "mlx":
        scale, bias = mlx_grid(w)
        q = _assign(w, scale, bias)
    else:
        q, scale, bias = _mse_grid(w, weight.dtype)
    return q.to(torch.uint8).reshape(out_f, in_f), scale.to(weight.dtype), bias.to(weight.dtype)


def _ascending(scale: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scale.abs(), torch.where(scale < 0, bias + _N_BINS * scale, bias)


def _zero_range(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
    step = ((hi - lo) / _N_BINS).clamp(min=_EPS)
    return step, torch.round(-lo / step).clamp_(0, _N_BINS)


def _zero_assign(w: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.round(w / step[..., None] + zero[..., None]).clamp_(0, _N_BINS)


def _zero_fit(w: torch.Tensor, q: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    d = q - zero[..., None]
    den, num = d.square().sum(-1), (d * w).sum(-1)
    fit = num / torch.where(den > 0, den, 1.0)
    return torch.where((den > 0) & (fit > 0), fit, step)


def _mlx_zero_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def zero_point_values(weight: torch.Tensor, group_size: int, grid: str = "mse"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [out, in], scale, zero uint8) as int4.zero_point_values wrote them before the row blocks."""
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
            for _ in range(2 if index else 0):
                step2 = _zero_fit(w, _zero_assign(w, step2, zero2), step2, zero2)
            stored = step2.to(weight.dtype).to(torch.float32)
            stored = torch.where(stored > 0, stored, torch.full_like(stored, _EPS))
            q2 = _zero_assign(w, stored, zero2)
            error2 = ((q2 - zero2[..., None]) * stored[..., None] - w).square_().sum(dim=-1)
            better = error2 < error if error is not None else torch.ones_like(error2, dtype=torch.bool)
            q = torch.where(better[..., None], q2, q)
            step, zero = torch.where(better, stored, step), torch.where(better, zero2, zero)
            error = error2 if error is None else torch.where(better, error2, error)
    return (q.to(torch.uint8).reshape(out_f, in_f), step.to(weight.dtype),
            zero.to(torch.uint8))
