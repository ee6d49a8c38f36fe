"""One row per quantization scheme: :data:`SCHEMES` and :func:`get`. Everything clef-local knows about a scheme
is reached through its row; the other packages ask the row instead of testing scheme names
(docs/quantization.md#adding-a-scheme).

Importing this module imports no torch (the planner reads the rows on torch-free installs): the tensor functions
import their scheme's module on first call. ``quant`` imports nothing else of clef_local, so what a row says about
the torch modules, the MLX loader, the ONNX graph and the synthetic releases are *names* that those packages resolve
(``torch_module``, ``mlx_loader``, ``onnx_nbits``, ``fake``), and the kernel names are the ones they record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEQUANTIZE = "dequantize"  # the kernel that rebuilds W per call (clef_local.backends.quantized's name)
DEQUANTIZE_AT_LOAD = "dequantize_at_load"  # MLX: the layer's weight dequantized once, at load
# torch's CUDA kernels' requirements (Scheme.cuda_needs), checked by clef_local.planning.choice.kernel_for
NEEDS_FP8 = "fp8"  # a card with fp8 tensor cores (sm_89+)
NEEDS_SM80 = "sm80"  # compute capability 8.0 or higher
NEEDS_BF16 = "bfloat16"  # bfloat16 activations


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme: its tensor functions behind a uniform signature, and what the rest of clef-local
    needs to know about it.

    Tensor functions: ``quantize(weight, group_size, **options)`` -> tensors (int4's options: ``grid``, see
    :mod:`.int4`, and ``layout``, ``mlx`` or ``compressed``, see :mod:`.int4_packed`);
    ``dequantize(tensors, group_size, dtype)`` -> weight; ``bits_per_weight(group_size)``;
    ``quantization_config(group_size, skip_modules=None, **options)`` -> the config.json dict (its writer; the same
    options; ``skip_modules``: the linear modules kept as released, which bitsandbytes' and compressed-tensors'
    configs list; int4's readers find its quantized layers by their ``scales`` instead). The reader is
    :func:`clef_local.formats.variant.variant_format`, which labels a clef-local config with :attr:`config_layout`.

    Groups: ``default_group_size`` is None where the scheme has no groups (int8, fp8: one scale per row); for nf4 it
    is the bitsandbytes block size, over the flattened weight (``flattened_blocks``). ``needs_divisible_input`` says
    whether the predicate must check ``in % group_size`` (only int4 groups run along the input dimension).
    ``group_sizes``: the groups it takes (None: any power of two >= 32). ``options``: the options a variant of it is
    written with when nobody chose (``--format mixed``).

    The planner: ``precision`` orders the schemes best first; ``stored_bytes(out, in, source_bytes, group_size,
    source_dtype)``: bytes of one ``[out, in]`` weight as stored (docs/quantization.md#schemes); ``flag``: the
    ``clef-local quantize`` flag that writes it. ``kernels``: (backend, device kind) -> the kernel its layers run
    (the names the backends record); ``half_precision_cpu_kernel``: torch's CPU kernel is used only with half-precision
    activations (float32 dequantizes); ``cuda_needs``: what torch's CUDA kernel needs (:data:`NEEDS_FP8`, ...;
    otherwise it dequantizes); ``needs_bitsandbytes``: torch runs it only through bitsandbytes;
    ``no_bitsandbytes_kernel``: the CUDA kernel without bitsandbytes.

    Stored tensors: ``weight_dtype``: the safetensors dtype of ``.weight``; ``extra_tensors``: the suffixes stored
    beside it, the first one marking a quantized module; ``packed_marker``: a second stored layout's marker (int4's
    compressed-tensors ``.weight_packed``); ``quantized_embeddings``: the loaders read its embeddings (mlx-lm's).

    Loading: ``torch_module``: the class in :mod:`clef_local.backends.quantized`; ``mlx_loader``: the function in
    :mod:`clef_local.backends.mlx_weights` that turns its stored tensors into an MLX layer (``mlx_quantized``: a
    quantized MLX layer; else a weight dequantized at load, ``dequantized_growth`` times the stored bytes);
    ``onnx_nbits``: the function in :mod:`clef_local.export.onnx.graph` that builds its MatMulNBits weight (None:
    no ONNX export). ``fake``: the function in :mod:`clef_local.synthetic` that writes its random stored tensors.

    Export: ``validation``: the thresholds of :func:`clef_local.export.validate.validate_export`;
    ``validation_requests``: the most probe requests its sequential verdict may use (a 1% flip limit needs ~500
    questions to be shown even with no flip; benchmarks/verdict_simulation.py); ``row_wise``: its
    quantize is bit-identical on row blocks (the export streams it so); GPTQ rounds it (:mod:`.gptq`) row blocks of
    whole groups only where ``flattened_blocks``.
    """

    name: str
    bits: int
    default_group_size: int | None
    needs_divisible_input: bool
    quantize: Callable[..., dict[str, torch.Tensor]]
    dequantize: Callable[..., torch.Tensor]
    bits_per_weight: Callable[..., float]
    quantization_config: Callable[..., dict[str, Any]]
    precision: int
    flag: str
    stored_bytes: Callable[[int, int, int, int, str], int]
    kernels: Mapping[tuple[str, str], str]
    weight_dtype: str
    extra_tensors: tuple[str, ...]
    torch_module: str
    mlx_loader: str
    validation: Mapping[str, float]
    config_layout: str
    fake: str
    group_sizes: tuple[int, ...] | None = None
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    flattened_blocks: bool = False
    half_precision_cpu_kernel: bool = False
    cuda_needs: tuple[str, ...] = ()
    needs_bitsandbytes: bool = False
    no_bitsandbytes_kernel: str | None = None
    packed_marker: str | None = None
    quantized_embeddings: bool = False
    mlx_quantized: bool = False
    dequantized_growth: float = 1.0
    onnx_nbits: str | None = None
    row_wise: bool = False
    validation_requests: int = 256

    @property
    def marker(self) -> str:
        """The stored suffix that marks a module quantized with this scheme (``.scales``, ``.weight_scale``, ...)."""
        return self.extra_tensors[0]

    def predicate_group_size(self, group_size: int | None = None) -> int | None:
        """The group size to hand to ``predicate.should_quantize`` for this scheme."""
        return (group_size or self.default_group_size) if self.needs_divisible_input else None

    def top_level_config(self, group_size: int | None = None, **options: Any) -> dict[str, Any]:
        """config.json members written beside ``quantization_config``: for int4 in the MLX layout mlx-lm's
        ``quantization`` block (``{"group_size", "bits": 4, "mode": "affine"}``, which mlx-lm reads before
        ``quantization_config``); none for the other schemes and layouts (mlx-lm would misread pack-quantized
        tensors)."""
        from . import int4, int4_packed

        if self.name == "int4" and options.get("layout", int4_packed.DEFAULT_LAYOUT) == "mlx":
            return {"quantization": int4.mlx_quantization(group_size or int4.DEFAULT_GROUP_SIZE)}
        return {}

    def join_rows(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The outputs of :attr:`quantize` on consecutive row blocks of one weight, as one call's: concatenated along
        the rows (the pack-quantized layout's shape and row-packed zero points: :func:`.int4_packed.join_rows`)."""
        import torch

        from . import int4_packed

        if "weight_shape" in parts[0]:
            return int4_packed.join_rows(parts)
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def _kernels(torch_cpu: str, torch_cuda: str, mlx_apple: str, mlx_cpu: str, onnx: str
             ) -> Mapping[tuple[str, str], str]:
    # a Mac without MLX runs torch on its CPU; ONNX Runtime's kernel is its CPU one
    return MappingProxyType({("torch", "cpu"): torch_cpu, ("torch", "apple"): torch_cpu, ("torch", "cuda"): torch_cuda,
                             ("mlx", "apple"): mlx_apple, ("mlx", "cpu"): mlx_cpu, ("onnx", "cpu"): onnx})


def _limits(mean_kl: float, flip_rate: float) -> Mapping[str, float]:
    return MappingProxyType({"mean_kl": mean_kl, "flip_rate": flip_rate})


def _int4_quantize(weight: torch.Tensor, group_size: int | None = None, grid: str | None = None,
                   layout: str | None = None) -> dict[str, torch.Tensor]:
    from . import int4, int4_packed

    layout = layout or int4_packed.DEFAULT_LAYOUT
    if layout not in int4_packed.LAYOUTS:
        raise ValueError(f"int4 layout must be one of {int4_packed.LAYOUTS}, got {layout!r}")
    quantize = int4_packed.quantize if layout == "compressed" else int4.quantize
    return quantize(weight, group_size or int4.DEFAULT_GROUP_SIZE, grid or int4.DEFAULT_GRID)


def _int4_dequantize(
    packed: dict[str, torch.Tensor], group_size: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    from . import int4, int4_packed

    dequantize = int4_packed.dequantize if "weight_packed" in packed else int4.dequantize
    return dequantize(packed, group_size or int4.DEFAULT_GROUP_SIZE, dtype)


def _int4_bits(group_size: int | None = None) -> float:
    from . import int4

    return int4.bits_per_weight(group_size or int4.DEFAULT_GROUP_SIZE)


def _int4_config(group_size: int | None = None, skip_modules: list[str] | None = None, grid: str | None = None,
                 layout: str | None = None) -> dict[str, Any]:
    from . import int4, int4_packed

    group = group_size or int4.DEFAULT_GROUP_SIZE
    if layout == "compressed":  # compressed-tensors' own schema; the grid is recorded in the clef_local member
        return int4_packed.quantization_config(group, skip_modules or ())
    return int4.quantization_config(group, grid or int4.DEFAULT_GRID)


def _int4_bytes(out_features: int, in_features: int, source_bytes: int, group_size: int, source_dtype: str) -> int:
    # 4-bit codes + a scale and a bias per group, in the source's float dtype
    return out_features * in_features // 2 + 2 * source_bytes * out_features * (in_features // group_size)


def _nf4_quantize(weight: torch.Tensor, group_size: int | None = None, **options: Any) -> dict[str, torch.Tensor]:
    from . import nf4

    return nf4.quantize(weight, group_size or nf4.DEFAULT_BLOCKSIZE, **options)


def _nf4_dequantize(
    packed: dict[str, torch.Tensor], group_size: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    from . import nf4

    return nf4.dequantize(packed, dtype)


def _nf4_bits(group_size: int | None = None, **options: Any) -> float:
    from . import nf4

    return nf4.bits_per_weight(group_size or nf4.DEFAULT_BLOCKSIZE, **options)


def _nf4_config(group_size: int | None = None, **options: Any) -> dict[str, Any]:
    from . import nf4

    return nf4.quantization_config(**options)


def _nf4_bytes(out_features: int, in_features: int, source_bytes: int, group_size: int, source_dtype: str) -> int:
    # 4-bit codes, a float32 absmax per block, the 16-entry code table, bitsandbytes' JSON quant state
    n = out_features * in_features
    state = json.dumps({"quant_type": "nf4", "blocksize": group_size, "dtype": source_dtype,
                        "shape": [out_features, in_features]})
    return (n + 1) // 2 + 4 * math.ceil(n / group_size) + 4 * 16 + len(state)


def _per_row_bytes(out_features: int, in_features: int, source_bytes: int, group_size: int, source_dtype: str) -> int:
    return out_features * in_features + 4 * out_features  # 8-bit codes + a float32 scale per row


def _per_row(module_name: str) -> tuple[Callable[..., dict[str, torch.Tensor]], Callable[..., torch.Tensor],
                                        Callable[..., float], Callable[..., dict[str, Any]]]:
    """int8's and fp8's tensor functions (one scale per row, no groups, no options)."""
    import importlib

    def module() -> Any:
        return importlib.import_module(f"{__package__}.{module_name}")

    def quantize(weight: torch.Tensor, group_size: int | None = None) -> dict[str, torch.Tensor]:
        return module().quantize(weight)

    def dequantize(packed: dict[str, torch.Tensor], group_size: int | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        return module().dequantize(packed, dtype or torch.float32)

    def bits_per_weight(group_size: int | None = None) -> float:
        return module().bits_per_weight()

    def quantization_config(group_size: int | None = None, skip_modules: list[str] | None = None) -> dict[str, Any]:
        return module().quantization_config(skip_modules or ())

    return quantize, dequantize, bits_per_weight, quantization_config


_INT8 = _per_row("int8")
_FP8 = _per_row("fp8")

# in the order schemes are listed to a user
SCHEMES: dict[str, Scheme] = {
    "int4": Scheme(
        name="int4", bits=4, default_group_size=64, needs_divisible_input=True, group_sizes=(32, 64, 128),
        options=MappingProxyType({"grid": "mse"}),
        quantize=_int4_quantize, dequantize=_int4_dequantize, bits_per_weight=_int4_bits,
        quantization_config=_int4_config, config_layout="mlx affine",
        precision=3, flag="--bits 4", stored_bytes=_int4_bytes,
        kernels=_kernels("int4pack_cpu", "tinygemm_cuda", "mlx_quantized_matmul", "mlx_dequantize_matmul",
                         "MatMulNBits"),
        half_precision_cpu_kernel=True, cuda_needs=(NEEDS_SM80, NEEDS_BF16),
        weight_dtype="U32", extra_tensors=(".scales", ".biases"), packed_marker=".weight_packed",
        quantized_embeddings=True,
        torch_module="Int4Linear", mlx_loader="int4_layer", mlx_quantized=True, onnx_nbits="int4_module_nbits",
        fake="int4_tensors", validation=_limits(0.03, 0.05), row_wise=True,
    ),
    "int8": Scheme(
        name="int8", bits=8, default_group_size=None, needs_divisible_input=False,
        quantize=_INT8[0], dequantize=_INT8[1], bits_per_weight=_INT8[2], quantization_config=_INT8[3],
        config_layout="clef-local per-channel (config before compressed-tensors)",
        precision=1, flag="--bits 8", stored_bytes=_per_row_bytes,
        kernels=_kernels("torch_int8pack_cpu", "bnb_int8", "mlx_quantized_matmul", "mlx_dequantize_matmul",
                         "MatMulNBits"),
        half_precision_cpu_kernel=True, no_bitsandbytes_kernel="int_mm_cuda",
        weight_dtype="I8", extra_tensors=(".weight_scale",),
        torch_module="Int8Linear", mlx_loader="int8_layer", mlx_quantized=True, onnx_nbits="int8_module_nbits",
        fake="int8_tensors", validation=_limits(0.002, 0.01), row_wise=True, validation_requests=1024,
    ),
    "nf4": Scheme(
        name="nf4", bits=4, default_group_size=64, needs_divisible_input=False, flattened_blocks=True,
        quantize=_nf4_quantize, dequantize=_nf4_dequantize, bits_per_weight=_nf4_bits,
        quantization_config=_nf4_config, config_layout="bitsandbytes nf4",
        precision=4, flag="--format nf4", stored_bytes=_nf4_bytes,
        kernels=_kernels("bnb_matmul_4bit", "bnb_matmul_4bit", DEQUANTIZE_AT_LOAD, DEQUANTIZE_AT_LOAD, DEQUANTIZE),
        needs_bitsandbytes=True,
        weight_dtype="U8",
        extra_tensors=(".weight.absmax", ".weight.quant_map", ".weight.quant_state", ".weight.nested_absmax",
                       ".weight.nested_quant_map"),
        torch_module="NF4Linear", mlx_loader="nf4_layer", dequantized_growth=16 / 4.5,  # 4.5 bits/weight -> BF16
        fake="nf4_tensors", validation=_limits(0.03, 0.05),
    ),
    "fp8": Scheme(
        name="fp8", bits=8, default_group_size=None, needs_divisible_input=False,
        quantize=_FP8[0], dequantize=_FP8[1], bits_per_weight=_FP8[2], quantization_config=_FP8[3],
        config_layout="clef-local per-channel (config before compressed-tensors)",
        precision=2, flag="--format fp8", stored_bytes=_per_row_bytes,
        kernels=_kernels(DEQUANTIZE, "scaled_mm_rowwise", DEQUANTIZE_AT_LOAD, DEQUANTIZE_AT_LOAD, DEQUANTIZE),
        cuda_needs=(NEEDS_FP8,),
        weight_dtype="F8_E4M3", extra_tensors=(".weight_scale",),
        torch_module="FP8Linear", mlx_loader="fp8_layer", dequantized_growth=2.0,  # 8 bits/weight -> BF16
        fake="fp8_tensors", validation=_limits(0.002, 0.01), row_wise=True, validation_requests=1024,
    ),
}


def get(name: str) -> Scheme:
    """The scheme called ``name`` (int4, int8, nf4, fp8); ValueError naming the known ones otherwise."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown quantization scheme {name!r}; known: {', '.join(SCHEMES)}") from None


def by_precision() -> tuple[str, ...]:
    """The schemes' names, best precision first."""
    return tuple(sorted(SCHEMES, key=lambda name: SCHEMES[name].precision))


def names_where(predicate: Callable[[Scheme], bool]) -> tuple[str, ...]:
    """The names of the schemes whose row satisfies ``predicate``, in :data:`SCHEMES` order."""
    return tuple(name for name, row in SCHEMES.items() if predicate(row))
