"""GPTQ (Frantar et al., 2022): round a weight column by column onto a scheme's own grid, folding each column's
rounding error into the columns not yet rounded, so that the layer's outputs on calibration inputs move least.

The math and how each scheme's grid is chosen from the updated weights: docs/quantization.md#gptq---calibrate. The
output is ``scheme.quantize``'s (same keys, dtypes and packing); with ``H = I`` it is round-to-nearest, bit for bit.
"""

from __future__ import annotations

import torch

from . import _rowwise, fp8, int4, int8, nf4

SCHEMES = ("int4", "int8", "fp8", "nf4")
DEFAULT_DAMP = 0.01  # GPTQ's default: enough to factor a rank-deficient H, small enough not to wash out its shape
BLOCK = 128  # columns per lazy batch update: the reference implementation's (wider for groups above it)


class _RowGrid:
    """int8 / fp8: one scale per row from the original weight; codes are the scheme's own dtype."""

    def __init__(self, scheme: str, weight: torch.Tensor) -> None:
        self.module = int8 if scheme == "int8" else fp8  # the scheme's own rounding step (its ``codes``)
        _, self.scale = _rowwise.scale(weight, self.module.QMAX, scheme)
        self.codes = torch.empty(weight.shape, dtype=self.module.CODE_DTYPE, device=weight.device)

    def start_group(self, column: int, weights: torch.Tensor) -> None:
        """Rows have one scale, fixed at construction."""

    def round(self, column: int, w: torch.Tensor) -> torch.Tensor:
        s = self.scale[:, 0]
        code = self.module.codes(w / s)
        self.codes[:, column] = code
        return code.to(torch.float32) * s

    def packed(self) -> dict[str, torch.Tensor]:
        return {"weight": self.codes, "weight_scale": self.scale}


class _Int4Grid:
    """int4: a (scale, bias) per group of ``group_size`` columns, chosen when the group's first column is reached."""

    def __init__(self, weight: torch.Tensor, group_size: int, grid: str) -> None:
        int4.check_shape(tuple(weight.shape), group_size)
        self.group_size, self.grid, self.dtype = group_size, grid, weight.dtype
        out_f, in_f = weight.shape
        self.codes = torch.empty(out_f, in_f, dtype=torch.uint8, device=weight.device)
        self.scales = torch.empty(out_f, in_f // group_size, dtype=weight.dtype, device=weight.device)
        self.biases = torch.empty_like(self.scales)
        self.assign: tuple[torch.Tensor, torch.Tensor] = (self.scales[:, 0], self.biases[:, 0])

    def start_group(self, column: int, weights: torch.Tensor) -> None:
        w = weights.to(self.dtype)
        _, scale, bias = int4.quantize_values(w, self.group_size, self.grid)
        g = column // self.group_size
        self.scales[:, g], self.biases[:, g] = scale[:, 0], bias[:, 0]
        # codes come from the stored (cast) pair on the mse grid, from the float32 pair on MLX's (as mx.quantize)
        self.assign = (int4.mlx_grid(w.to(torch.float32)[:, None, :]) if self.grid == "mlx"
                       else (scale[:, :1].to(torch.float32), bias[:, :1].to(torch.float32)))

    def round(self, column: int, w: torch.Tensor) -> torch.Tensor:
        g = column // self.group_size
        scale, bias = self.assign[0][:, 0], self.assign[1][:, 0]
        code = torch.round((w - bias) / scale).clamp_(0, 15)  # int4._assign on one column
        self.codes[:, column] = code.to(torch.uint8)
        return code * self.scales[:, g].to(torch.float32) + self.biases[:, g].to(torch.float32)

    def packed(self) -> dict[str, torch.Tensor]:
        return {"weight": int4.pack(self.codes), "scales": self.scales, "biases": self.biases}


class _NF4Grid:
    """nf4: an absmax per block of ``blocksize`` columns (blocks over the flattened weight lie within rows when the
    row length is a multiple of the block), chosen when the block's first column is reached."""

    def __init__(self, weight: torch.Tensor, blocksize: int) -> None:
        out_f, in_f = weight.shape
        if in_f % blocksize:
            raise ValueError(f"GPTQ nf4 needs in_features ({in_f}) to be a multiple of the block size {blocksize}: "
                             f"otherwise blocks straddle rows")
        self.blocksize, self.dtype, self.shape = blocksize, weight.dtype, tuple(weight.shape)
        self.codes = torch.empty(out_f, in_f, dtype=torch.uint8, device=weight.device)
        self.absmax = torch.empty(out_f, in_f // blocksize, dtype=torch.float32, device=weight.device)
        self.table = nf4.code_table(weight.device)
        self.midpoints = (self.table[:-1] + self.table[1:]) / 2

    def start_group(self, column: int, weights: torch.Tensor) -> None:
        self.absmax[:, column // self.blocksize] = weights.to(torch.float32).abs().amax(dim=1)

    def round(self, column: int, w: torch.Tensor) -> torch.Tensor:
        absmax = self.absmax[:, column // self.blocksize]
        scaled = torch.clamp(w * (1.0 / absmax.clamp(min=1e-38)), -1, 1)  # nf4.quantize_reference's steps
        code = torch.bucketize(scaled, self.midpoints)
        self.codes[:, column] = code.to(torch.uint8)
        return self.table[code] * absmax

    def packed(self) -> dict[str, torch.Tensor]:
        q = self.codes.reshape(-1)
        meta = {"quant_type": "nf4", "blocksize": self.blocksize, "dtype": nf4.dtype_name(self.dtype),
                "shape": list(self.shape)}
        return {"weight": ((q[0::2] << 4) | q[1::2])[:, None], "weight.absmax": self.absmax.reshape(-1),
                "weight.quant_map": self.table, nf4.QUANT_STATE_KEY: nf4.quant_state_blob(meta)}


def inverse_factor(hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): the upper Cholesky factor of the damped ``H⁻¹`` (float32) and the columns whose input is always 0.

    ValueError when H is not square or not positive definite after damping (NaNs in the calibration activations).
    """
    if hessian.dim() != 2 or hessian.shape[0] != hessian.shape[1]:
        raise ValueError(f"the Hessian must be square [in, in], got shape {tuple(hessian.shape)}")
    if not 0 <= damp < 1:
        raise ValueError(f"damp must be in [0, 1), got {damp}")
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError("the Hessian is not positive definite after damping (non-finite calibration inputs?)")
    inverse = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32), dead


def quantize(weight: torch.Tensor, hessian: torch.Tensor, scheme: str, group_size: int | None = None, *,
             grid: str = int4.DEFAULT_GRID, damp: float = DEFAULT_DAMP) -> dict[str, torch.Tensor]:
    """GPTQ-quantize a 2-D weight [out, in] with its input Hessian [in, in] into ``scheme``'s packed tensors.

    ``group_size`` is int4's group (default 64) or nf4's block (default 64); ``grid`` int4's rule. The output
    equals ``scheme.quantize``'s in keys, dtypes, shapes and layout. ValueError for another scheme, a Hessian of the
    wrong size, or (nf4) rows that are not whole blocks.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"GPTQ covers {', '.join(SCHEMES)}, not {scheme!r}")
    if weight.dim() != 2:
        raise ValueError(f"GPTQ quantizes 2-D weights [out, in], got shape {tuple(weight.shape)}")
    n = weight.shape[1]
    if tuple(hessian.shape) != (n, n):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not match the weight's {n} input columns")
    grids: _RowGrid | _Int4Grid | _NF4Grid
    if scheme == "int4":
        grids = _Int4Grid(weight, group_size or int4.DEFAULT_GROUP_SIZE, grid)
        group = grids.group_size
    elif scheme == "nf4":
        grids = _NF4Grid(weight, group_size or nf4.DEFAULT_BLOCKSIZE)
        group = grids.blocksize
    else:
        grids, group = _RowGrid(scheme, weight), n
    u, dead = inverse_factor(hessian.to(weight.device), damp)
    w = weight.detach().to(torch.float32).clone()
    w[:, dead] = 0
    # a lazy batch holds whole groups (nf4 blocks may be 256 wide); a row grid's one "group" never needs them
    width = BLOCK if isinstance(grids, _RowGrid) else max(BLOCK, group)
    for b0 in range(0, n, width):
        b1 = min(b0 + width, n)
        block, errors, ub = w[:, b0:b1].clone(), torch.empty_like(w[:, b0:b1]), u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            c = b0 + i
            if c % group == 0:  # the group's columns as they stand now (all inside this batch)
                grids.start_group(c, block[:, i : i + group])
            column = block[:, i]
            error = (column - grids.round(c, column)) / ub[i, i]
            block[:, i:] -= error[:, None] * ub[i, i:][None, :]
            errors[:, i] = error
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    return grids.packed()


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr((A - W) H (A - W)ᵀ)``: the summed squared output error over the calibration inputs' second moment."""
    delta = approx.to(weight.device, torch.float32) - weight.to(torch.float32)
    return float(((delta @ hessian.to(weight.device, torch.float32)) * delta).sum())
