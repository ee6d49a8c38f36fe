"""Quantized linear layers of the torch backend, swapped in before a variant's weights are loaded (docs/format.md §6).

Two-phase loading (gpt-fast's pattern): on the meta device each quantized ``nn.Linear`` becomes its scheme's module
(:func:`swap_linears`) and the packed tensors are assigned as stored, so no full-precision copy is made; then
:func:`prepare_quantized` picks each layer's kernel once (the table, and how a CPU runs prefills: docs/quantization.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from clef_local.errors import ReleaseError
from clef_local.formats.quant_plan import MIXED, LayerFormat, layer_index
from clef_local.formats.safetensors import DTYPES
from clef_local.quant import fp8, int4, int4_cpu, int4_packed, int8, nf4, registry

log = logging.getLogger(__name__)

TensorSpec = tuple[tuple[int, ...], torch.dtype]
DEQUANTIZE = "dequantize"
# torch's int4 and int8 CPU kernels are fast only with half-precision activations: with float32 ones
# dequantize-then-matmul wins by far (docs/benchmarks.md#int4-and-int8-on-a-cpu), so float32 dequantizes.
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# from here the int8 kernel's per-row cost passes the blocked conversion's fixed one
# (docs/benchmarks.md#int4-and-int8-on-a-cpu)
INT8_KERNEL_ROWS = 16
BNB_MISSING = "nf4 variants need bitsandbytes: pip install bitsandbytes"
REPACK_ROWS_BUDGET = 1 << 18  # weights per block of the int4 repack (a few MiB of transient int64 nibbles)
# tinygemm vs dequantize-then-matmul at load (bf16 activations, error / max |x @ W.T|): bf16 rounding of the
# output is ~4e-3; a wrong nibble order or zero point is off by 10-100%.
TINYGEMM_CHECK = 2e-2


class QuantizedLinear(nn.Module):
    """Base of the per-scheme modules: ``y = x @ W.T (+ bias)`` with ``W`` held in a scheme's packed form.

    ``KEYS`` maps each stored key (relative to the module path, as in the file) to its buffer name; they are the
    same except for nf4's dotted keys (a buffer name cannot hold a dot), renamed on load and back on save.
    ``kernel`` is ``"unprepared"`` until :meth:`prepare` picks the path, once, on the final device.
    """

    scheme: ClassVar[str]
    KEYS: ClassVar[dict[str, str]]
    REQUIRED: ClassVar[tuple[str, ...]]

    def __init__(self, in_features: int, out_features: int, specs: Mapping[str, TensorSpec], *,
                 bias: TensorSpec | None, compute_dtype: torch.dtype, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype
        self.kernel, self.kernel_reason = "unprepared", ""
        missing = [k for k in self.REQUIRED if k not in specs]
        unknown = [k for k in specs if k not in self.KEYS]
        if missing or unknown:
            raise ReleaseError(f"{self.scheme} layer: missing stored tensor(s) {missing}, unknown {unknown}")
        for key, (shape, dtype) in specs.items():
            self.register_buffer(self.KEYS[key], torch.empty(shape, dtype=self.held_dtype(key, dtype), device=device))
        self.register_buffer("bias", None if bias is None else torch.empty(bias[0], dtype=bias[1], device=device))
        self._check(specs)

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        """Raise :class:`ReleaseError` when the stored shapes/dtypes do not fit [out, in]."""

    def held_dtype(self, key: str, stored: torch.dtype) -> torch.dtype:
        """The dtype a stored tensor is held in (the loader casts floating tensors to it): as stored."""
        return stored

    def _expect(self, specs: Mapping[str, TensorSpec], key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        found = specs[key]
        if tuple(found[0]) != shape or found[1] != dtype:
            raise ReleaseError(f"{self.scheme} tensor {key!r} is {list(found[0])} {found[1]}, expected {list(shape)} "
                               f"{dtype} for a [{self.out_features}, {self.in_features}] linear layer")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for key, name in self.KEYS.items():
            if key != name and prefix + key in state_dict:
                state_dict[prefix + name] = state_dict.pop(prefix + key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, name in self.KEYS.items():
            if key != name and prefix + name in destination:
                destination[prefix + key] = destination.pop(prefix + name)

    def packed(self) -> dict[str, torch.Tensor]:
        """The stored tensors still held, by their file keys."""
        return {key: t for key, name in self.KEYS.items() if (t := getattr(self, name, None)) is not None}

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W`` [out, in] in ``dtype`` by the scheme's dequantize (a full-precision copy: per call only)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Pick the kernel for the module's device and compute dtype (called once, after the move to the device)."""
        raise NotImplementedError

    def _set_kernel(self, kernel: str, reason: str = "") -> None:
        self.kernel, self.kernel_reason = kernel, reason  # a fallback's reason is logged by prepare_quantized

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}, kernel={self.kernel}")


def repack_int4(packed: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype,
                rows: int = REPACK_ROWS_BUDGET, *, convert: Callable[..., int4.TorchInt4]) -> int4.TorchInt4:
    """``convert`` (:func:`quant.int4_cpu.repack` in a layout or :func:`quant.int4.to_tinygemm`) applied to blocks of
    rows (a multiple of 64 rows, about ``rows`` weights each) and concatenated: bit-identical to the whole-matrix
    repack (tested), with a transient memory of one block (the unpacking makes 8 bytes per weight), not one layer."""
    out_f, words = packed["weight"].shape
    step = max(64, rows // (words * int4.PACK) // 64 * 64)
    weight: torch.Tensor | None = None
    scales_and_zeros: torch.Tensor | None = None
    for start in range(0, out_f, step):  # preallocated: a list + cat would leave its copy resident
        block = convert({k: v[start:start + step] for k, v in packed.items()}, group_size, dtype)
        if weight is None or scales_and_zeros is None:  # the kernel layouts' leading dimension is proportional
            per_row = block.weight.shape[0] / min(step, out_f)  # to the rows (1 or 1/8 per row)
            weight = block.weight.new_empty((int(out_f * per_row), *block.weight.shape[1:]))
            scales_and_zeros = block.scales_and_zeros.new_empty((block.scales_and_zeros.shape[0], out_f, 2))
        weight[int(start * per_row):int((start + step) * per_row)] = block.weight
        scales_and_zeros[:, start:start + step] = block.scales_and_zeros
    return int4.TorchInt4(weight, group_size, scales_and_zeros)


class Int4Linear(QuantizedLinear):
    """int4 (MLX affine layout): ``W[r, c] = scales[r, c // g] * q[r, c] + biases[r, c // g]``.

    ``tinygemm_cuda``: the stored tensors are repacked exactly into the CUDA kernel's tiles
    (:func:`quant.int4.to_tinygemm`: ``w = (q - 8) * s + z`` with ``s = scale``, ``z = bias + 8 * scale``), the
    MLX-layout buffers are then released (one 4-bit copy stays), and ``y = aten._weight_int4pack_mm(x, ...)``;
    checked once at load against dequantize-then-matmul on a few random rows (a wrong repack would otherwise decide
    silently wrong), falling back to ``dequantize`` with the error. ``int4pack_cpu`` (a CPU with bf16 or fp16
    activations): repacked the same way into torch's CPU kernel layout (:mod:`quant.int4_cpu`), checked once at load
    on the first rows (torch's kernel against the blocked dequantize of the same bytes); calls under
    :data:`quant.int4_cpu.KERNEL_ROWS` rows run ``aten._weight_int4pack_mm_for_cpu``, longer ones dequantize the
    same bytes block by block into the dense matmul (docs/quantization.md#kernels). ``dequantize``: ``y = x @
    (scales * q + biases).T`` rebuilt per call (on a CPU a block of rows at a time:
    :func:`quant.int4_cpu.stored_matmul`).
    """

    scheme = "int4"
    KEYS: ClassVar[dict[str, str]] = {"weight": "weight", "scales": "scales", "biases": "biases"}
    # buffers registered in __init__; the CUDA kernel's repack sets them to None
    weight: torch.Tensor | None
    scales: torch.Tensor | None
    biases: torch.Tensor | None
    REQUIRED = ("weight", "scales", "biases")

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        self._expect(specs, "weight", (self.out_features, self.in_features // int4.PACK), torch.uint32)
        groups = self._groups(specs, "scales")
        self._expect(specs, "biases", (self.out_features, groups), specs["scales"][1])

    def _groups(self, specs: Mapping[str, TensorSpec], scales: str) -> int:
        """The groups per row that the ``scales`` tensor stores, checked; sets :attr:`group_size`."""
        groups = specs[scales][0][-1]
        self.group_size = self.in_features // groups if groups else 0
        if self.group_size not in int4.GROUP_SIZES or self.group_size * groups != self.in_features:
            raise ReleaseError(f"int4 {scales} {list(specs[scales][0])} give no valid group size for in_features "
                               f"{self.in_features} (allowed: {int4.GROUP_SIZES})")
        self._expect(specs, scales, (self.out_features, groups), specs[scales][1])
        return groups

    def affine(self) -> dict[str, torch.Tensor]:
        """The stored tensors in the MLX layout every int4 path reads (``weight`` words viewed as int32: the same
        bits, which unpack masks, so no uint32 arithmetic is needed)."""
        packed = self.packed()
        packed["weight"] = packed["weight"].view(torch.int32)
        return packed

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return int4.dequantize(self.affine(), self.group_size, dtype)

    def prepare(self) -> None:
        held = self.packed()
        if len(held) < len(self.REQUIRED):
            raise RuntimeError("int4 layer prepared twice (its stored buffers were released)")
        device = next(iter(held.values())).device
        if device.type == "cuda":
            self._prepare_tinygemm(device)
        elif device.type != "cpu":
            self._set_kernel(DEQUANTIZE, f"no int4 kernel wired for {device.type}")
        elif self.compute_dtype not in KERNEL_DTYPES:  # a choice, not a fallback (docs/quantization.md#kernels)
            self._set_kernel(DEQUANTIZE)
        else:
            self._prepare_int4pack_cpu()

    def _prepare_int4pack_cpu(self) -> None:
        if reason := int4_cpu.unsupported(self.out_features, self.in_features, self.group_size):
            self._set_kernel(DEQUANTIZE, reason)
            return
        layout = int4_cpu.cpu_layout()
        if layout is None:  # unsupported() said so already; kept for the type checker
            self._set_kernel(DEQUANTIZE, f"torch {torch.__version__} packs int4 in an unknown layout")
            return
        repacked = repack_int4(self.affine(), self.group_size, self.compute_dtype,
                               convert=lambda block, group, dtype: int4_cpu.repack(block, group, dtype, layout))
        # The first rows through torch's kernel and through the blocked dequantize: two readers of the bytes, torch's
        # and ours, so a layout that is not the one torch reads is off by 10-100% (no full-precision copy is made).
        rows = min(self.out_features, int4_cpu.CHUNK)
        pairs = repacked.scales_and_zeros[:, :rows].contiguous()  # the kernel reads them with a stride of rows
        head = int4.TorchInt4(repacked.weight[:rows], self.group_size, pairs)
        x = torch.randn(4, self.in_features, dtype=self.compute_dtype, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            reference = int4_cpu.matmul(x, head, layout, kernel_rows=0).float()
            kernel = int4_cpu.matmul(x, head, layout, kernel_rows=len(x) + 1).float()
            error = float((kernel - reference).abs().max() / reference.abs().max().clamp_min(1e-12))
        if error > TINYGEMM_CHECK:
            log.warning("int4 layer [%d, %d]: torch's CPU int4 kernel disagrees with the blocked dequantize of the "
                        "same bytes (max relative error %.2e > %.0e); using dequantize", self.out_features,
                        self.in_features, error, TINYGEMM_CHECK)
            self._set_kernel(DEQUANTIZE, f"int4pack_cpu self-check failed (error {error:.1e})")
            return
        self._use_repack(repacked, "int4pack_cpu")

    def _prepare_tinygemm(self, device: torch.device) -> None:
        if reason := int4.tinygemm_unsupported(device, self.compute_dtype, self.out_features, self.in_features,
                                               self.group_size):
            self._set_kernel(DEQUANTIZE, reason)
            return
        x = torch.randn(4, self.in_features, device=device, dtype=int4.TINYGEMM_DTYPE,
                        generator=torch.Generator(device).manual_seed(0))
        try:  # a torch build without kernels for this GPU raises here, not at the first request
            repacked = repack_int4(self.affine(), self.group_size, int4.TINYGEMM_DTYPE, convert=int4.to_tinygemm)
            with torch.inference_mode():
                reference = F.linear(x.float(), self.dequantize(torch.float32))
                error = float((int4.tinygemm_matmul(x, repacked).float() - reference).abs().max()
                              / reference.abs().max().clamp_min(1e-12))
        except RuntimeError as exc:
            log.warning("int4 layer [%d, %d]: tinygemm unavailable (%s); using dequantize", self.out_features,
                        self.in_features, exc)
            self._set_kernel(DEQUANTIZE, f"tinygemm unavailable: {str(exc).splitlines()[0][:120]}")
            return
        if error > TINYGEMM_CHECK:
            log.warning("int4 layer [%d, %d]: tinygemm disagrees with dequantize-then-matmul (max relative error "
                        "%.2e > %.0e); using dequantize", self.out_features, self.in_features, error, TINYGEMM_CHECK)
            self._set_kernel(DEQUANTIZE, f"tinygemm self-check failed (error {error:.1e})")
            return
        self._use_repack(repacked, "tinygemm_cuda")

    def _use_repack(self, repacked: int4.TorchInt4, kernel: str) -> None:
        self.register_buffer("int4pack", repacked.weight, persistent=False)
        self.register_buffer("scales_and_zeros", repacked.scales_and_zeros, persistent=False)
        for name in self.KEYS.values():  # the kernel's copy replaces the stored layout
            setattr(self, name, None)
        self._set_kernel(kernel)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if (matmul := INT4_MATMULS.get(self.kernel)) is not None:
            return matmul(x, int4.TorchInt4(self.int4pack, self.group_size, self.scales_and_zeros)).to(x.dtype)
        if x.device.type == "cpu":  # dequantize, a block of rows at a time
            y = int4_cpu.stored_matmul(x.reshape(-1, x.shape[-1]), self.affine(), self.group_size)
            return y.reshape(*x.shape[:-1], self.out_features)
        return super()._matmul(x)


class PackedInt4Linear(Int4Linear):
    """int4 in compressed-tensors' pack-quantized layout (:mod:`quant.int4_packed`): ``W[r, c] = weight_scale[r, g]
    * (q[r, c] - zero[r, g])``. Held as stored; every path reads :meth:`affine`, the MLX-layout form with
    ``biases = -scale * zero`` in float32 (exact), so the kernels, their load-time checks and the blocked CPU
    dequantize are :class:`Int4Linear`'s. A symmetric checkpoint (no ``weight_zero_point``) has zero 8."""

    KEYS: ClassVar[dict[str, str]] = {key: key for key in int4_packed.KEYS}
    REQUIRED = ("weight_packed", "weight_scale", "weight_shape")

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        self._expect(specs, "weight_packed", (self.out_features, self.in_features // int4.PACK), torch.int32)
        groups = self._groups(specs, "weight_scale")
        if "weight_zero_point" in specs:
            self._expect(specs, "weight_zero_point", (-(-self.out_features // int4.PACK), groups), torch.int32)
        self._expect(specs, "weight_shape", (2,), specs["weight_shape"][1])

    def affine(self) -> dict[str, torch.Tensor]:
        return int4_packed.to_affine(self.packed())


# the repacked int4 kernels by the name Int4Linear records
INT4_MATMULS: dict[str, Callable[[torch.Tensor, int4.TorchInt4], torch.Tensor]] = {
    "tinygemm_cuda": int4.tinygemm_matmul, "int4pack_cpu": int4_cpu.matmul}


def bnb_int8_matmul(x: torch.Tensor, weight: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """LLM.int8 without outliers (threshold 0): ``x`` is quantized per token, ``sx = max|x_row| / 127``,
    ``xq = rint(x / sx)`` (from float16, as bitsandbytes does), ``acc = xq @ q.T`` in int32, and
    ``y = acc * sx * SCB / 127²`` where ``SCB = 127 * weight_scale`` (our int8 weight is bitsandbytes' ``CB``)."""
    import bitsandbytes.functional as bnb_f

    lead = x.shape[:-1]
    xq, sx, _ = bnb_f.int8_vectorwise_quant(x.reshape(-1, x.shape[-1]).to(torch.float16))
    y = torch.ops.bitsandbytes.int8_scaled_mm.default(xq, weight, sx, scb, bias=None, dtype=x.dtype)
    return y.reshape(*lead, y.shape[-1])


SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a per-row scale's stored dtypes


class _PerRowLinear(QuantizedLinear):
    """Shared layout of int8 and fp8: ``weight`` [out, in] (one byte each) and ``weight_scale`` float32 [out, 1]."""

    KEYS: ClassVar[dict[str, str]] = {"weight": "weight", "weight_scale": "weight_scale"}
    REQUIRED = ("weight", "weight_scale")
    weight: torch.Tensor  # buffers registered in __init__
    weight_scale: torch.Tensor
    WEIGHT_DTYPE: ClassVar[torch.dtype]

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        self._expect(specs, "weight", (self.out_features, self.in_features), self.WEIGHT_DTYPE)
        stored = specs["weight_scale"][1]
        self._expect(specs, "weight_scale", (self.out_features, 1), stored if stored in SCALE_DTYPES else torch.float32)

    def held_dtype(self, key: str, stored: torch.dtype) -> torch.dtype:
        """``weight_scale`` in float32 whatever float dtype it is stored in: compressed-tensors' compressors store
        it in the model's dtype (bf16), clef-local in float32; the widening is exact."""
        return torch.float32 if key == "weight_scale" and stored in SCALE_DTYPES else stored


class Int8Linear(_PerRowLinear):
    """int8 symmetric per row: ``W[r, c] = q[r, c] * weight_scale[r]``.

    ``torch_int8pack_cpu``: ``y = aten._weight_int8pack_mm(x, q, scale)`` = ``(x @ q.T) * scale`` (weight-only;
    the scale is cast to the activation dtype) for calls of fewer than :data:`INT8_KERNEL_ROWS` rows; longer ones,
    and ``dequantize`` on a CPU, run :func:`quant.int8.blocked_matmul` (``q`` converted block by block, the scale
    applied to the output). ``bnb_int8``: :func:`bnb_int8_matmul` (activations quantized too). ``int_mm_cuda``
    (CUDA without bitsandbytes; in and out multiples of 8): :func:`quant.int8.int_mm_matmul`, ``torch._int_mm`` on
    int8 activations. ``dequantize`` elsewhere: ``y = x @ (q * scale).T`` per call.
    """

    scheme = "int8"
    WEIGHT_DTYPE = torch.int8

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return int8.dequantize(self.packed(), dtype)

    def prepare(self) -> None:
        device = self.weight.device
        if device.type == "cpu" and self.compute_dtype in KERNEL_DTYPES:
            self.weight = int8.aligned(self.weight)  # the kernel crashes (SIGSEGV) on bf16 x and an unaligned weight
            self._set_kernel("torch_int8pack_cpu")
        elif device.type == "cuda" and nf4.bitsandbytes_available():
            self.use_bnb_int8()
        elif device.type == "cuda" and not (self.in_features % 8 or self.out_features % 8):
            self.use_int_mm()
        else:
            self._set_kernel(DEQUANTIZE, f"no fast int8 kernel for {device.type} / {self.compute_dtype}"
                             + (" (bitsandbytes is not installed)" if device.type == "cuda" else ""))

    def use_bnb_int8(self) -> None:
        """Run through :func:`bnb_int8_matmul` (CUDA's choice; bitsandbytes' CPU backend runs it too, for tests)."""
        self.register_buffer("scb", (self.weight_scale.reshape(-1) * int8.QMAX).float(), persistent=False)
        self._set_kernel("bnb_int8")

    def use_int_mm(self) -> None:
        """Run through :func:`quant.int8.int_mm_matmul` (CUDA without bitsandbytes; CPUs run it too, for tests)."""
        self._set_kernel("int_mm_cuda", "" if nf4.bitsandbytes_available() else "bitsandbytes is not installed")

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "torch_int8pack_cpu" and x.numel() < INT8_KERNEL_ROWS * x.shape[-1]:
            return int8.int8_matmul(x, self.packed())
        if self.kernel == "bnb_int8":
            return bnb_int8_matmul(x, self.weight, self.scb)
        if self.kernel == "int_mm_cuda":  # CPUs run it too (tests, the kernel table of benchmarks/flagship.py)
            return int8.int_mm_matmul(x, self.packed())
        if self.weight.device.type == "cpu":  # the kernel's long calls and dequantize: block by block
            return int8.blocked_matmul(x, self.packed())
        return super()._matmul(x)


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales: ``sx = max|x_row| / 448``, ``xq = e4m3(x / sx)``,
    ``y = (xq @ q.T) * sx * weight_scale.T`` (fp8 products, float32 accumulation), in ``out_dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    sx = (x2.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX).clamp_(min=1e-12)
    xq = (x2 / sx).clamp_(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE)
    y = torch._scaled_mm(xq, weight.t(), scale_a=sx.contiguous(), scale_b=scale_row, out_dtype=out_dtype)
    return y.reshape(*lead, y.shape[-1])


class FP8Linear(_PerRowLinear):
    """fp8 (e4m3fn, per-row scale): ``W[r, c] = float32(q[r, c]) * weight_scale[r]``.

    ``dequantize`` (CPU, and CUDA below sm_89): ``y = x @ (q.float() * scale).to(x.dtype).T`` per call.
    ``scaled_mm_rowwise`` (CUDA sm_89+): :func:`fp8_scaled_mm` (activations quantized per token to e4m3).
    """

    scheme = "fp8"
    WEIGHT_DTYPE = fp8.FP8_DTYPE

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(self.packed(), dtype)

    def prepare(self) -> None:
        device = self.weight.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
        reason = (f"{device.type}: torch._scaled_mm is not used off CUDA (docs/hardware.md)" if device.type != "cuda"
                  else f"sm_{capability[0]}{capability[1]} < sm_89" if capability < (8, 9)
                  else "in or out features % 16 != 0 (torch._scaled_mm)" if self.in_features % 16
                  or self.out_features % 16 else "")
        if reason:
            self._set_kernel(DEQUANTIZE, reason)
            return
        probe = torch.ones(16, self.in_features, device=device, dtype=self.compute_dtype)
        errors = []
        for out_dtype in dict.fromkeys((self.compute_dtype, torch.bfloat16)):  # row-wise scaling may need bf16 out
            self.use_scaled_mm(out_dtype)
            try:
                self._matmul(probe)
                return
            except RuntimeError as exc:  # an unsupported output dtype / layout is a RuntimeError in torch
                errors.append(f"{out_dtype}: {exc}")
        self._set_kernel(DEQUANTIZE, "torch._scaled_mm refused: " + "; ".join(errors))

    def use_scaled_mm(self, out_dtype: torch.dtype) -> None:
        """Run through :func:`fp8_scaled_mm` with output dtype ``out_dtype`` (CUDA sm_89+'s choice; torch's CPU
        ``_scaled_mm`` runs it too, slowly, for tests only)."""
        self.register_buffer("scale_row", self.weight_scale.reshape(1, -1).float().contiguous(), persistent=False)
        self.fp8_out_dtype = out_dtype
        self._set_kernel("scaled_mm_rowwise")

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "scaled_mm_rowwise":
            return fp8_scaled_mm(x, self.weight, self.scale_row, self.fp8_out_dtype).to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype))


class NF4Linear(QuantizedLinear):
    """nf4 (bitsandbytes serialization): ``W = NF4_CODE[q] * absmax[block]`` over the flattened weight.

    ``bnb_matmul_4bit``: ``bitsandbytes.matmul_4bit(x, weight.t(), quant_state)`` with a ``QuantState`` rebuilt from
    the stored tensors (CPU: bitsandbytes' ``dequantize_4bit`` in the activation dtype + ``F.linear``; CUDA: its 4-bit
    kernels). The functional call never repacks the weight (``Linear4bit``'s AVX512-BF16 repack, a known trap in
    docs/hardware.md, is a module behaviour that this class does not have).
    """

    scheme = "nf4"
    KEYS: ClassVar[dict[str, str]] = {
        "weight": "weight", "weight.absmax": "absmax", "weight.quant_map": "quant_map",
        nf4.QUANT_STATE_KEY: "quant_state_blob", "weight.nested_absmax": "nested_absmax",
        "weight.nested_quant_map": "nested_quant_map",
    }
    REQUIRED = ("weight", "weight.absmax", "weight.quant_map", nf4.QUANT_STATE_KEY)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not nf4.bitsandbytes_available():
            raise ImportError(BNB_MISSING)
        super().__init__(*args, **kwargs)

    def _check(self, specs: Mapping[str, TensorSpec]) -> None:
        n = self.out_features * self.in_features
        self._expect(specs, "weight", ((n + 1) // 2, 1), torch.uint8)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return nf4.dequantize(self.packed(), dtype)

    def prepare(self) -> None:
        from bitsandbytes.functional import QuantState

        state = {k.removeprefix("weight."): v for k, v in self.packed().items() if k != "weight"}
        self.quant_state = QuantState.from_dict(state, self.weight.device)
        if tuple(self.quant_state.shape) != (self.out_features, self.in_features):
            raise ReleaseError(f"nf4 quant_state shape {list(self.quant_state.shape)} does not match the linear "
                               f"layer [{self.out_features}, {self.in_features}]")
        self._set_kernel("bnb_matmul_4bit")

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes

        return bitsandbytes.matmul_4bit(x, self.weight.t(), quant_state=self.quant_state)


# each scheme's module, named by its row (clef_local.quant.registry)
MODULES: dict[str, type[QuantizedLinear]] = {name: globals()[row.torch_module]
                                             for name, row in registry.SCHEMES.items()}
PACKED = ".weight_packed"  # compressed-tensors' pack-quantized int4 (its .weight_scale is no int8 / fp8 marker)


def _markers() -> dict[str, tuple[str, ...]]:
    """A quantized module's marker tensor -> the schemes that store it (a packed layout's marker too)."""
    markers: dict[str, tuple[str, ...]] = {}
    for name, row in registry.SCHEMES.items():
        for marker in (row.marker, row.packed_marker):
            if marker is not None:
                markers[marker] = (*markers.get(marker, ()), name)
    return markers


_MARKERS = _markers()
_WEIGHT_DTYPES = {name: getattr(torch, DTYPES[row.weight_dtype].torch) for name, row in registry.SCHEMES.items()}
_PACKED_SCHEMES = frozenset(name for name, row in registry.SCHEMES.items() if row.packed_marker == PACKED)


def quantized_prefixes(headers: Mapping[str, TensorSpec], scheme: str,
                       plan: Mapping[int, LayerFormat] | None = None) -> dict[str, str]:
    """{module path: scheme} for every quantized linear in the headers: the paths with a scheme's extra tensor
    (``.scales``, ``.weight_scale``, ``.weight.absmax``) whose ``.weight`` has the scheme's stored dtype. A ``mixed``
    variant names the scheme per decoder layer (``plan``, :func:`clef_local.formats.quant_plan.mixed_plan`): each
    module is checked against its own layer's."""
    if scheme == MIXED and plan is None:
        raise ReleaseError("config.json names scheme mixed but has no per-layer plan (quantization_config.clef_local"
                           ".layers); re-export the variant")
    if scheme != MIXED and scheme not in MODULES:
        raise ReleaseError(f"unknown quantization scheme {scheme!r} in config.json; known: {', '.join(MODULES)}, "
                           f"{MIXED}")
    found: dict[str, str] = {}
    for name in headers:
        for marker, schemes in _MARKERS.items():
            if not name.endswith(marker):
                continue
            prefix = name[: -len(marker)]
            if marker != PACKED and prefix + PACKED in headers:
                continue
            expected = scheme if scheme != MIXED else _planned(prefix, plan or {})
            weight = headers.get(prefix + (PACKED if marker == PACKED else ".weight"))
            dtype = torch.int32 if marker == PACKED else _WEIGHT_DTYPES.get(expected)
            if expected not in schemes or weight is None or weight[1] != dtype:
                where = "the scheme config.json names" if scheme != MIXED else \
                    f"the scheme config.json's plan names for its layer ({expected})"
                raise ReleaseError(f"tensor {name} (weight dtype {weight and weight[1]}) is not a {expected} layer, "
                                   f"{where}")
            found[prefix] = expected
    return found


def _planned(prefix: str, plan: Mapping[int, LayerFormat]) -> str:
    index = layer_index(prefix)
    fmt = plan.get(index) if index is not None else None
    if fmt is None:
        raise ReleaseError(f"{prefix} holds quantized tensors but its layer ({index}) is not in config.json's mixed "
                           "plan (quantization_config.clef_local.layers)")
    return fmt.scheme


def swap_linears(model: nn.Module, prefixes: Mapping[str, str], headers: Mapping[str, TensorSpec], *,
                 dtype: torch.dtype, device: torch.device | str = "meta") -> dict[str, QuantizedLinear]:
    """Replace the ``nn.Linear`` at each path of ``prefixes`` (path → scheme) by the scheme's module, built on
    ``device`` (meta: no memory) with the stored tensors' shapes/dtypes from ``headers``; ``dtype`` is the compute
    dtype. Returns {path: new module}."""
    swapped: dict[str, QuantizedLinear] = {}
    for prefix, scheme in prefixes.items():
        try:
            linear = model.get_submodule(prefix)
        except AttributeError as exc:
            raise ReleaseError(f"quantized tensors {prefix}.* belong to no module of the backbone") from exc
        if not isinstance(linear, nn.Linear):
            raise ReleaseError(f"{prefix} is a {type(linear).__name__}, not a linear layer; it cannot be {scheme}")
        start = prefix + "."
        specs = {k[len(start):]: v for k, v in headers.items() if k.startswith(start) and k != start + "bias"}
        bias = None if linear.bias is None else (tuple(linear.bias.shape), linear.bias.dtype)
        cls = PackedInt4Linear if scheme in _PACKED_SCHEMES and "weight_packed" in specs else MODULES[scheme]
        module = cls(linear.in_features, linear.out_features, specs, bias=bias, compute_dtype=dtype, device=device)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
        swapped[prefix] = module
    return swapped


def prepare_quantized(model: nn.Module) -> dict[str, str]:
    """Pick every quantized layer's kernel (once, on its device); log a summary at INFO; {path: "scheme:kernel"}."""
    layers: dict[str, str] = {}
    reasons: Counter[tuple[str, str]] = Counter()
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            module.prepare()
            layers[name] = f"{module.scheme}:{module.kernel}"
            reasons[(layers[name], module.kernel_reason)] += 1
    if reasons:
        log.info("quantized layers: %s", "; ".join(
            f"{count} × {kernel}" + (f" ({reason})" if reason else "") for (kernel, reason), count in reasons.items()))
    return layers


STREAMED = "streamed from disk: a kernel that repacks at prepare() would repack on every load"


def stream_kernels(model: nn.Module) -> dict[str, str]:
    """Set the kernel of every quantized layer of a streamed backbone (:mod:`clef_local.backends.streaming`), once,
    on the meta device; {path: "scheme:kernel"}. A streamed layer's tensors are read again for every batch, so what
    :meth:`QuantizedLinear.prepare` builds from them (tinygemm's tiles, int8's aligned copy, fp8's probe) would be
    rebuilt per load: int4, int8 and fp8 dequantize per call (no preparation at all), nf4 keeps bitsandbytes, whose
    ``QuantState`` is only a view of the stored tensors (:func:`after_stream_load`)."""
    layers: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, NF4Linear):
            module._set_kernel("bnb_matmul_4bit")
        elif isinstance(module, QuantizedLinear):
            module._set_kernel(DEQUANTIZE, STREAMED)
        else:
            continue
        layers[name] = f"{module.scheme}:{module.kernel}"
    return layers


def after_stream_load(module: nn.Module) -> None:
    """After a streamed group's tensors are assigned: nf4 rebuilds its ``QuantState`` from them."""
    for child in module.modules():
        if isinstance(child, NF4Linear):
            child.prepare()


def before_stream_release(module: nn.Module) -> None:
    """Before a streamed group goes back to the meta device: drop what :func:`after_stream_load` built."""
    for child in module.modules():
        if isinstance(child, NF4Linear):
            child.quant_state = None


def kernel_counts(layers: Mapping[str, str]) -> dict[str, int]:
    """{"scheme:kernel": number of layers} from :func:`prepare_quantized`'s result."""
    return dict(Counter(layers.values()))
