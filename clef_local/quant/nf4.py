"""nf4: bitsandbytes 4-bit NormalFloat, blocks of 64, in the serialization ``transformers`` reloads (``Linear4bit``).

The rule, the packing and the serialized keys (double quantization included):
docs/quantization.md#the-rounding-rules-exactly. :func:`quantize` uses bitsandbytes when it imports and the
bit-identical :func:`quantize_reference` otherwise.
"""

from __future__ import annotations

import importlib.util
import json

import torch

BITS = 4
DEFAULT_BLOCKSIZE = 64
QUANT_STATE_KEY = "weight.quant_state.bitsandbytes__nf4"
# The 16 NF4 values, exactly as bitsandbytes stores them (float32).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def code_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The NF4 code as a float32 tensor [16]."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, as bitsandbytes' serialized quant state names it."""
    return str(dtype).removeprefix("torch.")


def quant_state_blob(meta: dict) -> torch.Tensor:
    """The ``quant_state`` tensor bitsandbytes serializes: the JSON of ``meta`` as uint8 bytes."""
    return torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)


def read_quant_state(packed: dict[str, torch.Tensor]) -> dict:
    """Decode the JSON blob of ``weight.quant_state.bitsandbytes__nf4``."""
    return json.loads(bytes(packed[QUANT_STATE_KEY].tolist()).decode("utf-8"))


def quantize_reference(weight: torch.Tensor, blocksize: int = DEFAULT_BLOCKSIZE) -> dict[str, torch.Tensor]:
    """Pure-torch NF4 (no double quantization): the serialized tensors of a ``Linear4bit`` weight."""
    flat = weight.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)[:, None]), -1, 1).reshape(-1)
    if full < n:
        tail_max = flat[full:].abs().max()
        absmax = torch.cat([absmax, tail_max[None]])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail_max.clamp(min=1e-38), -1, 1)])
    if n % 2:
        scaled = torch.cat([scaled, scaled.new_zeros(1)])
    code = code_table(flat.device)
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2).to(torch.uint8)
    meta = {"quant_type": "nf4", "blocksize": blocksize, "dtype": dtype_name(weight.dtype)}
    meta["shape"] = list(weight.shape)
    return {
        "weight": ((q[0::2] << 4) | q[1::2])[:, None],
        "weight.absmax": absmax,
        "weight.quant_map": code,
        QUANT_STATE_KEY: quant_state_blob(meta),
    }


def bitsandbytes_available() -> bool:
    """Whether bitsandbytes can be imported (found without importing it: the import takes seconds)."""
    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["bitsandbytes"] is None (import blocked)
        return False


def quantize(
    weight: torch.Tensor, blocksize: int = DEFAULT_BLOCKSIZE, double_quant: bool = False
) -> dict[str, torch.Tensor]:
    """NF4-quantize ``weight`` to the tensors ``transformers`` saves for a ``Linear4bit``.

    Uses bitsandbytes when installed (required for ``double_quant``), else :func:`quantize_reference`.
    Quantizes from the tensor, never through a module forward (docs/hardware.md, known traps: the CPU repack trap).
    """
    if not bitsandbytes_available():
        if double_quant:
            raise RuntimeError("nf4 double quantization needs bitsandbytes (pip install bitsandbytes)")
        return quantize_reference(weight, blocksize)
    from bitsandbytes.functional import quantize_4bit

    data, state = quantize_4bit(
        weight.detach().contiguous().cpu(), blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4"
    )
    out = {"weight": data}
    out.update({f"weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    return out


def _absmax(packed: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    absmax = packed["weight.absmax"]
    if "weight.nested_absmax" not in packed:
        return absmax.to(torch.float32)
    nested_code = packed["weight.nested_quant_map"].to(torch.float32)
    nested_absmax = packed["weight.nested_absmax"].to(torch.float32)
    index = torch.arange(absmax.numel(), device=absmax.device) // meta["nested_blocksize"]
    values = nested_code[absmax.reshape(-1).long()] * nested_absmax[index]
    return values + meta["nested_offset"]


def dequantize(packed: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``NF4_CODE[q] * absmax`` (float32) reshaped to the stored shape, cast to ``dtype`` (default: stored dtype)."""
    meta = read_quant_state(packed)
    shape = tuple(meta["shape"])
    n = 1
    for size in shape:
        n *= size
    data = packed["weight"].reshape(-1).view(torch.uint8)
    q = torch.stack([data >> 4, data & 0xF], dim=-1).reshape(-1)[:n].long()
    code = packed["weight.quant_map"].to(torch.float32)
    absmax = _absmax(packed, meta)
    block = torch.arange(n, device=q.device) // meta["blocksize"]
    out = (code[q] * absmax[block]).reshape(shape)
    return out.to(dtype or getattr(torch, meta["dtype"]))


def bits_per_weight(group_size: int = DEFAULT_BLOCKSIZE, double_quant: bool = False) -> float:
    """4 bits + float32 absmax per block; with double quantization a uint8 per block + float32 per 256 blocks."""
    if double_quant:
        return BITS + 8 / group_size + 32 / (group_size * 256)
    return BITS + 32 / group_size


def quantization_config(
    skip_modules: list[str] | None = None, double_quant: bool = False, compute_dtype: str = "bfloat16"
) -> dict:
    """The dict ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", ...).to_dict()`` writes.

    ``skip_modules`` must name every module kept unquantized (transformers otherwise swaps them for ``Linear4bit``).
    """
    return {
        "quant_method": "bitsandbytes",
        "_load_in_8bit": False,
        "_load_in_4bit": True,
        "llm_int8_threshold": 6.0,
        "llm_int8_skip_modules": list(skip_modules) if skip_modules is not None else None,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": double_quant,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "load_in_4bit": True,
        "load_in_8bit": False,
    }
