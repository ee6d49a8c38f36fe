"""compressed-tensors' ``quantization_config`` for fp8, int8 (per channel) and int4 (per group), written and read back.

The fp8 variant's tensors (``weight`` float8_e4m3fn + float32 ``weight_scale`` [out, 1]) and the int8 variant's
(``weight`` int8 + ``weight_scale``) are compressed-tensors' ``float-quantized`` / ``int-quantized`` layouts of a
symmetric per-channel weight, so their config is compressed-tensors' own schema (what vLLM, SGLang and transformers
read). ``input_activations`` says what clef-local's CUDA kernels compute: both quantize the activations per token,
dynamically and symmetrically, to the weight's type (fp8: ``torch._scaled_mm`` row-wise; int8: bitsandbytes'
LLM.int8 without outliers or ``torch._int_mm``; backends/quantized.py), i.e. compressed-tensors' ``FP8_DYNAMIC`` and
``W8A8`` presets. On a CPU clef-local runs them weight-only (docs/quantization.md#what-reads-each-variant).
int4 in the ``pack-quantized`` layout (:mod:`clef_local.quant.int4_packed`) is weight-only (W4A16): 4-bit asymmetric
weights per group, no input activations (vLLM's / SGLang's WNA16 kernels with zero points).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

QUANT_METHOD = "compressed-tensors"
# scheme -> (compressed-tensors format, QuantizationArgs.type)
FORMATS = {"fp8": ("float-quantized", "float"), "int8": ("int-quantized", "int"), "int4": ("pack-quantized", "int")}
BITS = 8
INT4_BITS = 4
INT4_GROUPS = (32, 64, 128)  # clef-local's int4 groups (quant.int4.GROUP_SIZES); vLLM's Marlin takes each


def _args(kind: str, strategy: str, dynamic: bool, bits: int = BITS, group_size: int | None = None,
          symmetric: bool = True) -> dict[str, Any]:
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "group_size": group_size, "strategy": strategy,
            "dynamic": dynamic}


def quantization_config(scheme: str, ignore: Iterable[str] = (), group_size: int | None = None) -> dict[str, Any]:
    """``quantization_config`` of an fp8, int8 or int4 variant: one config group over every ``Linear``; fp8 / int8:
    weights 8-bit symmetric per output channel (static), input activations 8-bit symmetric per token (dynamic);
    int4: weights 4-bit asymmetric per group of ``group_size`` input columns, no input activations (W4A16).
    ``ignore``: the linear modules kept as released (``lm_head``, the vision tower, the layers the predicate skips),
    sorted."""
    if scheme not in FORMATS:
        raise ValueError(f"compressed-tensors configs are written for {', '.join(FORMATS)}, not {scheme!r}")
    fmt, kind = FORMATS[scheme]
    if scheme == "int4":
        if group_size not in INT4_GROUPS:
            raise ValueError(f"pack-quantized int4 group_size must be one of {INT4_GROUPS}, not {group_size!r}")
        weights = _args(kind, "group", False, INT4_BITS, group_size, symmetric=False)
        activations = None
    else:
        weights, activations = _args(kind, "channel", False), _args(kind, "token", True)
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations, "output_activations": None,
                                      "format": fmt}},
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def scheme_of(qconfig: Mapping[str, Any]) -> str:
    """The scheme of a compressed-tensors ``quantization_config`` (:func:`read_weights`)."""
    return read_weights(qconfig)[0]


def read_weights(qconfig: Mapping[str, Any]) -> tuple[str, int | None]:
    """(scheme, group size) of a compressed-tensors ``quantization_config`` whose weights are a layout clef-local
    reads: one config group, with 8-bit symmetric per-channel weights of a ``float-quantized`` / ``int-quantized``
    format (fp8 / int8, group None) or 4-bit integer weights per group of 32, 64 or 128 columns of a
    ``pack-quantized`` one (int4; asymmetric or symmetric, without activation reordering). ValueError naming what
    differs otherwise (another format, block or channel strategies, several config groups)."""
    fmt = qconfig.get("format")
    groups = qconfig.get("config_groups")
    scheme = next((s for s, (f, _) in FORMATS.items() if f == fmt), None)
    if scheme is None:
        raise ValueError(f"compressed-tensors format {fmt!r} is not one clef-local reads (it reads "
                         f"{', '.join(f for f, _ in FORMATS.values())}: fp8 / int8 per output channel, int4 per "
                         f"group)")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ValueError(f"compressed-tensors config_groups: clef-local reads one group, not "
                         f"{len(groups) if isinstance(groups, Mapping) else groups!r}")
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if scheme == "int4":
        return scheme, _int4_group(weights)
    expected = {"num_bits": BITS, "type": FORMATS[scheme][1], "symmetric": True, "strategy": "channel"}
    found = {k: weights.get(k) for k in expected} if isinstance(weights, Mapping) else {}
    if found != expected:
        raise ValueError(f"compressed-tensors {fmt} weights {found or weights!r}: clef-local reads {expected}")
    return scheme, None


def _int4_group(weights: Any) -> int:
    expected = {"num_bits": INT4_BITS, "type": "int", "strategy": "group"}
    found = {k: weights.get(k) for k in (*expected, "group_size", "actorder")} if isinstance(weights, Mapping) else {}
    group, actorder = found.pop("group_size", None), found.pop("actorder", None)
    if found != expected or group not in INT4_GROUPS or actorder not in (None, False):
        raise ValueError(f"compressed-tensors pack-quantized weights {weights!r}: clef-local reads {expected} with "
                         f"group_size {'/'.join(map(str, INT4_GROUPS))} and no actorder; re-export with one of those "
                         f"group sizes and without activation reordering")
    return int(group)
