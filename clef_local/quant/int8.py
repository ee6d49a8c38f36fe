"""int8: symmetric per output row, ``W ≈ q · scale[row]`` with q in -127..127 and the scale in float32.

The rule, its error bound and the stored keys: docs/quantization.md#the-rounding-rules-exactly.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _rowwise, compressed

BITS = 8
QMAX = 127
CODE_DTYPE = torch.int8


def codes(values: torch.Tensor) -> torch.Tensor:
    """``w / scale`` rounded to the nearest integer in -127..127 (in place), as int8."""
    return torch.round(values).clamp_(-QMAX, QMAX).to(CODE_DTYPE)


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize a 2-D weight [out, in] to ``{"weight": int8 [out, in], "weight_scale": float32 [out, 1]}``."""
    return _rowwise.quantize(weight, QMAX, "int8", codes)


dequantize = _rowwise.dequantize  # q · scale in float32, cast to the dtype asked for


def bits_per_weight(group_size: int | None = None, in_features: int = 4096) -> float:
    """8 bits plus one float32 scale per row of ``in_features`` weights (the group size does not apply)."""
    return _rowwise.bits_per_weight(BITS, in_features)


def quantization_config(ignore: Iterable[str] = ()) -> dict:
    """config.json ``quantization_config``: compressed-tensors' ``int-quantized`` schema for these tensors
    (:func:`.compressed.quantization_config`; ``ignore``: the linear modules kept as released)."""
    return compressed.quantization_config("int8", ignore)


def aligned(tensor: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """``tensor``, or a copy at an ``alignment``-byte address when it is not (torch's CPU allocator aligns to 64).

    ``aten._weight_int8pack_mm`` crashes the process (SIGSEGV) on bf16 activations when the weight does not start
    on a 64-byte boundary, which tensors read from a safetensors file often do not.
    """
    return tensor if tensor.data_ptr() % alignment == 0 else tensor.clone()


def int8_matmul(x: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x @ W.T``: torch's ``aten._weight_int8pack_mm`` on CPU for float32/bfloat16/float16 ``x``, else dequantize.

    The kernel takes scales in the activation dtype (bf16 activations: the scale is rounded to bf16) and returns
    ``x.dtype``.
    """
    weight, scale = packed["weight"], packed["weight_scale"]
    kernel_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in kernel_dtypes:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, aligned(weight.contiguous()),
                                               scale.reshape(-1).to(x.dtype).contiguous())
        return y.reshape(*lead, y.shape[-1])
    return x @ dequantize(packed, x.dtype).T


# Output features converted per block by blocked_matmul: 32 MiB of bf16 at in_features 4096. Each block is one
# matmul (one parallel region): at 256 features (a cache-sized 2 MiB block) the 48 small matmuls of a Clef-flash MLP
# weight ran at 37-80% of the dense matmul when another process shared the cores, 4,096 at 73-92%
# (docs/benchmarks.md#int4-and-int8-on-a-cpu); quiet, every size from 256 to 12,288 ran at 72-89%, 4,096 within a few
# percent of the best. The conversion is a small share of a long call's work either way.
CHUNK = 4096


def blocked_matmul(x: torch.Tensor, packed: dict[str, torch.Tensor], chunk: int = CHUNK) -> torch.Tensor:
    """``x @ W.T`` without a full-size dequantized copy: each block of ``chunk`` output features is converted to
    ``x.dtype`` in one reused buffer (exact: |q| ≤ 127 is a bf16 value), multiplied into its columns of the output,
    and the per-row scales are applied to the output, once per output element instead of once per weight."""
    weight, scale = packed["weight"], packed["weight_scale"]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n, k = weight.shape
    y = x2.new_empty(x2.shape[0], n)
    buffer = x2.new_empty(min(chunk, n) * k)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        block = buffer[:(stop - start) * k].view(stop - start, k)
        block.copy_(weight[start:stop])
        torch.mm(x2, block.T, out=y[:, start:stop])
    y.mul_(scale.reshape(1, n))
    return y.reshape(*lead, n)


INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows: shorter inputs are padded with zero rows


def int_mm_matmul(x: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """``x @ W.T`` with int8 activations and ``torch._int_mm`` (W8A8, the int8 tensor-core GEMM on CUDA; CPUs run
    it too): ``sx = max|x_row| / 127``, ``xq = rint(x / sx)``, ``acc = xq @ q.T`` in int32, ``y = acc · sx ·
    scale.T`` in float32, cast to ``x.dtype``. Per element the activations' rounding adds at most ``sx / 2``.
    ``in`` and ``out`` must be multiples of 8 on CUDA."""
    weight, scale = packed["weight"], packed["weight_scale"]
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1]).shape[0]
    x2 = x.reshape(rows, x.shape[-1]).float()
    sx = (x2.abs().amax(dim=1, keepdim=True) / QMAX).clamp_(min=1e-12)
    xq = torch.round(x2 / sx).clamp_(-QMAX, QMAX).to(torch.int8)
    if x.device.type == "cuda" and rows < INT_MM_MIN_ROWS:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - rows))
    acc = torch._int_mm(xq, weight.t())[:rows]
    y = acc.float().mul_(sx).mul_(scale.reshape(1, -1).float())
    return y.to(x.dtype).reshape(*lead, y.shape[-1])
