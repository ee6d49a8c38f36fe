"""int4 on a CPU: torch's packed kernel for short calls, a blocked dequantize-matmul from the same bytes for long ones.

torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``) reads the 4-bit codes in a layout of its own, written
by ``aten._convert_weight_to_int4pack_for_cpu``, which depends on the vector width torch was dispatched to
(:class:`PackLayout`). :func:`cpu_layout` finds this build's layout by comparing each candidate with torch's own
converter, once per process; with it the same bytes serve both paths (:func:`matmul`), so a layer holds one 4-bit
copy. The kernel's cost grows with every row, so from :data:`KERNEL_ROWS` rows on the codes are dequantized in
blocks of :data:`CHUNK` output features that stay in cache (bf16 arithmetic, no full-size float32 temporary) and
each block runs the dense matmul. Measured in docs/benchmarks.md#int4-and-int8-on-a-cpu
(``benchmarks/quant_cpu_kernels.py``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .int4 import TorchInt4, check_shape, dequantize, scales_and_zeros, unpack

# From this many rows a call dequantizes; below it torch's kernel runs (docs/benchmarks.md#int4-and-int8-on-a-cpu).
KERNEL_ROWS = 80
# Output features dequantized per block: a multiple of every candidate layout's block (dequantize_t walks whole
# blocks); 2 MiB of bf16 at in_features 4096, so it stays in cache while its matmul reads it.
CHUNK = 256
_XOR = 0x88  # flips bit 3 of both nibbles: a nibble q read as signed 4 bits is then q - 8 (the kernel's code)


class PackLayout(NamedTuple):
    """How ``_convert_weight_to_int4pack_for_cpu`` lays out codes ``q`` [N, K] (0..15) as uint8 [N, K / 2].

    Rows go in blocks of ``block`` (64 where torch runs AVX512, 32 with AVX2 or without vectors); each block is
    stored whole, as [K, rows / 2] bytes. In a full block, byte j of column k holds row j in its low nibble and row
    j + block / 2 in its high one when ``lanes``, else rows 2j and 2j + 1: the form a shorter last block always has.
    """

    block: int
    lanes: bool


CANDIDATES = tuple(PackLayout(block, lanes) for block in (64, 32, 16) for lanes in (True, False))


def pack(q: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """Codes ``q`` [N, K] (0..15, any int dtype) → uint8 [N, K / 2] in ``layout`` (what torch's converter writes)."""
    n, k = q.shape
    q = q.to(torch.uint8)
    full = n // layout.block * layout.block
    parts = []
    if full:
        blocks = q[:full].reshape(full // layout.block, layout.block, k).transpose(1, 2)  # [blocks, K, rows]
        half = layout.block // 2
        low, high = (blocks[..., :half], blocks[..., half:]) if layout.lanes else (blocks[..., 0::2], blocks[..., 1::2])
        parts.append((low | high << 4).reshape(-1))
    if full < n:
        tail = q[full:].T
        parts.append((tail[:, 0::2] | tail[:, 1::2] << 4).reshape(-1))
    return torch.cat(parts).view(n, k // 2)


@functools.cache
def cpu_layout() -> PackLayout | None:
    """This torch build's layout: the candidate that reproduces ``_convert_weight_to_int4pack_for_cpu`` exactly on
    random codes of two shapes (full blocks of every candidate size and a shorter last block), or None when none
    does (a torch that packs otherwise: then the int4 layers dequantize from the stored layout)."""
    generator = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.int32)
              for rows, cols in ((3 * 128 + 16, 64), (2 * 64 + 48, 96))]
    try:
        packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1) for q in probes]
    except (RuntimeError, AttributeError):  # a torch without the CPU int4 kernel
        return None
    for layout in CANDIDATES:
        if all(p.shape == (q.shape[0], q.shape[1] // 2) and torch.equal(p.view(torch.uint8), pack(q, layout))
               for q, p in zip(probes, packed, strict=True)):
            return layout
    return None


def unsupported(out_features: int, in_features: int, group_size: int) -> str:
    """Why torch's CPU int4 kernel cannot hold this layer ("" when it can)."""
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16 (torch's CPU int4 kernel)"
    check_shape((out_features, in_features), group_size)
    if cpu_layout() is None:
        return f"torch {torch.__version__} packs int4 in a layout this clef-local does not know"
    return ""


def repack(packed: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype, layout: PackLayout) -> TorchInt4:
    """MLX-layout int4 (``weight`` uint32 or its int32 view, ``scales``, ``biases``) → torch's CPU kernel inputs in
    ``layout``, with ``scales_and_zeros`` in ``dtype`` (the activations'): the bytes torch's converter writes
    (:func:`cpu_layout` checked that), built with vectorized byte operations."""
    words = packed["weight"]
    q = unpack(words.view(torch.int32) if words.dtype == torch.uint32 else words)
    return TorchInt4(pack(q, layout), group_size, scales_and_zeros(packed, dtype))


def dequantize_t(repacked: TorchInt4, layout: PackLayout, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """``W.T[:, start:stop]`` = ``(q − 8)·s + z`` per group, written into ``out`` (a contiguous [K, stop − start]
    tensor of the output dtype) from the kernel's bytes. ``start`` is a multiple of ``layout.block``, ``stop`` too
    or the last row. In bf16 this is ``int4.dequantize`` exactly (one rounding of an exact float32 value)."""
    weight, group, pairs = repacked
    n = weight.shape[0]
    k = weight.shape[1] * 2
    rows = stop - start
    flat = weight.view(torch.uint8).reshape(-1)
    full_stop = min(stop, n // layout.block * layout.block)
    full = max(0, full_stop - start)
    columns = out.view(k, rows)
    if full:
        nblocks = full // layout.block
        codes = (flat[start * k // 2:full_stop * k // 2].view(nblocks, k, layout.block // 2) ^ _XOR).view(torch.int8)
        low, high = ((codes << 4) >> 4).permute(1, 0, 2), (codes >> 4).permute(1, 0, 2)  # [K, blocks, rows / 2]
        if layout.lanes:  # a block's first half of rows in the low nibbles, its second half in the high ones
            target = columns[:, :full].view(k, nblocks, 2, layout.block // 2)
            target[:, :, 0].copy_(low)
            target[:, :, 1].copy_(high)
        else:
            target = columns[:, :full].view(k, nblocks, layout.block // 2, 2)
            target[..., 0].copy_(low)
            target[..., 1].copy_(high)
    if full < rows:  # the shorter last block: pairs of rows
        codes = (flat[full_stop * k // 2:stop * k // 2].view(k, (rows - full) // 2) ^ _XOR).view(torch.int8)
        target = columns[:, full:].view(k, (rows - full) // 2, 2)
        target[..., 0].copy_((codes << 4) >> 4)
        target[..., 1].copy_(codes >> 4)
    grouped = columns.view(k // group, group, rows)
    # contiguous copies of the block's (s, z) [groups, rows]: broadcasting from the interleaved pairs is far slower
    # (docs/benchmarks.md#int4-and-int8-on-a-cpu)
    scale = pairs[:, start:stop, 0].to(out.dtype).contiguous().unsqueeze(1)
    zero = pairs[:, start:stop, 1].to(out.dtype).contiguous().unsqueeze(1)
    return torch.addcmul(zero, grouped, scale, out=grouped).view(k, rows)


def stored_matmul(x: torch.Tensor, packed: dict[str, torch.Tensor], group_size: int,
                  chunk: int = CHUNK) -> torch.Tensor:
    """``x @ W.T`` from the stored (MLX) layout for a 2-D ``x``, for layers that do not take torch's layout (float32
    activations, ``out % 16 != 0``): :func:`int4.dequantize` of ``chunk`` rows at a time, so its float32
    temporaries stay in cache instead of spanning the whole weight (the weights are :func:`int4.dequantize`'s)."""
    n = packed["weight"].shape[0]
    y = x.new_empty(x.shape[0], n)
    for start in range(0, n, chunk):
        block = {key: value[start:start + chunk] for key, value in packed.items()}
        torch.mm(x, dequantize(block, group_size, x.dtype).T, out=y[:, start:start + chunk])
    return y


def blocked_matmul(x: torch.Tensor, repacked: TorchInt4, layout: PackLayout, chunk: int = CHUNK) -> torch.Tensor:
    """``x @ W.T`` for a 2-D ``x`` [M, K]: each block of ``chunk`` output features is dequantized into one reused
    buffer (:func:`dequantize_t`) and multiplied into its columns of the output."""
    n = repacked.weight.shape[0]
    k = x.shape[1]
    y = x.new_empty(x.shape[0], n)
    buffer = x.new_empty(k * min(chunk, n))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        w_t = dequantize_t(repacked, layout, start, stop, buffer[:k * (stop - start)].view(k, stop - start))
        torch.mm(x, w_t, out=y[:, start:stop])
    return y


def matmul(x: torch.Tensor, repacked: TorchInt4, layout: PackLayout | None = None,
           kernel_rows: int = KERNEL_ROWS) -> torch.Tensor:
    """``x @ W.T`` (``x`` [..., K], cast to the repack's dtype): torch's kernel below ``kernel_rows`` rows, else
    :func:`blocked_matmul`; ``layout`` defaults to :func:`cpu_layout`."""
    layout = layout or cpu_layout()
    if layout is None:
        raise RuntimeError(f"torch {torch.__version__} packs int4 in a layout this clef-local does not know")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(repacked.scales_and_zeros.dtype).contiguous()
    if x2.shape[0] < kernel_rows:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, repacked.weight, repacked.group_size,
                                                       repacked.scales_and_zeros)
    else:
        y = blocked_matmul(x2, repacked, layout)
    return y.reshape(*lead, y.shape[-1])
