"""compressed-tensors' ``quantization_config`` for the per-channel 8-bit schemes (fp8, int8), written and read back.

The fp8 variant's tensors (``weight`` float8_e4m3fn + float32 ``weight_scale`` [out, 1]) and the int8 variant's
(``weight`` int8 + ``weight_scale``) are compressed-tensors' ``float-quantized`` / ``int-quantized`` layouts of a
symmetric per-channel weight, so their config is compressed-tensors' own schema (what vLLM, SGLang and transformers
read). ``input_activations`` says what clef-local's CUDA kernels compute: both quantize the activations per token,
dynamically and symmetrically, to the weight's type (fp8: ``torch._scaled_mm`` row-wise; int8: bitsandbytes'
LLM.int8 without outliers or ``torch._int_mm``; backends/quantized.py), i.e. compressed-tensors' ``FP8_DYNAMIC`` and
``W8A8`` presets. On a CPU clef-local runs them weight-only (docs/quantization.md#what-reads-each-variant).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

QUANT_METHOD = "compressed-tensors"
# scheme -> (compressed-tensors format, QuantizationArgs.type)
FORMATS = {"fp8": ("float-quantized", "float"), "int8": ("int-quantized", "int")}
BITS = 8


def _args(kind: str, strategy: str, dynamic: bool) -> dict[str, Any]:
    return {"num_bits": BITS, "type": kind, "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": dynamic}


def quantization_config(scheme: str, ignore: Iterable[str] = ()) -> dict[str, Any]:
    """``quantization_config`` of an fp8 or int8 variant: one config group over every ``Linear``, weights 8-bit
    symmetric per output channel (static), input activations 8-bit symmetric per token (dynamic); ``ignore``: the
    linear modules kept as released (``lm_head``, the vision tower, the layers the predicate skips), sorted."""
    if scheme not in FORMATS:
        raise ValueError(f"compressed-tensors configs are written for {', '.join(FORMATS)}, not {scheme!r}")
    fmt, kind = FORMATS[scheme]
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _args(kind, "channel", False),
                                      "input_activations": _args(kind, "token", True), "output_activations": None,
                                      "format": fmt}},
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def scheme_of(qconfig: Mapping[str, Any]) -> str:
    """The scheme (fp8 or int8) of a compressed-tensors ``quantization_config`` whose weights are the layout
    clef-local reads: one config group, 8-bit symmetric per-channel weights of a ``float-quantized`` /
    ``int-quantized`` format. ValueError naming what differs otherwise (another format such as ``pack-quantized``,
    group or block strategies, asymmetric weights, several config groups)."""
    fmt = qconfig.get("format")
    groups = qconfig.get("config_groups")
    scheme = next((s for s, (f, _) in FORMATS.items() if f == fmt), None)
    if scheme is None:
        raise ValueError(f"compressed-tensors format {fmt!r} is not one clef-local reads (it reads "
                         f"{', '.join(f for f, _ in FORMATS.values())}: fp8 / int8 per output channel)")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ValueError(f"compressed-tensors config_groups: clef-local reads one group, not "
                         f"{len(groups) if isinstance(groups, Mapping) else groups!r}")
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, Mapping) else None
    expected = {"num_bits": BITS, "type": FORMATS[scheme][1], "symmetric": True, "strategy": "channel"}
    found = {k: weights.get(k) for k in expected} if isinstance(weights, Mapping) else {}
    if found != expected:
        raise ValueError(f"compressed-tensors {fmt} weights {found or weights!r}: clef-local reads {expected}")
    return scheme
