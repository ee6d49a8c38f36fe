"""What gets quantized: the 2-D linear weights inside the text model's decoder layers, nothing else.

The exact rule (name patterns, the gated-delta-net inputs and MoE routers kept, the group-size condition) is
docs/format.md §6, "What is quantized"; every kept layer is returned with its reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

QUANTIZED = "text-model linear layer"
NOT_DIVISIBLE = "in_features % group_size != 0"

_TEXT_LINEAR = re.compile(
    r"^(?:model\.language_model\.|language_model\.model\.|model\.)layers\.\d+\.(?:self_attn|linear_attn|mlp)\."
    r"(?P<proj>[A-Za-z0-9_.]+)\.weight$"
)
_KEPT_PROJECTIONS = {
    "in_proj_a": "gated-delta-net decay input (in_proj_a) kept in the source dtype",
    "in_proj_b": "gated-delta-net beta input (in_proj_b) kept in the source dtype",
    "gate": "MoE router (mlp.gate) kept in the source dtype",
    "shared_expert_gate": "MoE shared-expert gate kept in the source dtype",
}


def _excluded(parts: list[str]) -> str | None:
    """The reason a name is never quantized, from its dotted components, or None."""
    for part in parts:
        low = part.lower()
        if low == "lm_head":
            return "lm_head (the joint head reads it)"
        if "embed" in low:
            return "embedding"
        if low in ("visual", "vision_tower", "vision_model") or low.startswith("vision"):
            return "vision tower"
        if "joint" in low or low.endswith("_head") or low == "head":
            return "joint schema head"
        if "norm" in low:
            return "norm"
        if low in ("mtp", "mtp_layers"):
            return "multi-token prediction layer"
    return None


def should_quantize(name: str, shape: tuple[int, ...], group_size: int | None) -> tuple[bool, str]:
    """Decide whether tensor ``name`` of ``shape`` is quantized; returns (decision, reason)."""
    if not name.endswith(".weight"):
        return False, "not a .weight tensor"
    reason = _excluded(name.split("."))
    if reason is not None:
        return False, reason
    match = _TEXT_LINEAR.match(name)
    if match is None:
        return False, "not a linear layer of the text model's decoder layers"
    if len(shape) != 2:
        return False, f"not 2-D (shape {tuple(shape)})"
    proj = match.group("proj").split(".")[-1]
    if proj in _KEPT_PROJECTIONS:
        return False, _KEPT_PROJECTIONS[proj]
    if group_size is not None and shape[1] % group_size:
        return False, NOT_DIVISIBLE
    return True, QUANTIZED


def split(
    shapes: Mapping[str, tuple[int, ...]] | Iterable[tuple[str, tuple[int, ...]]], group_size: int | None
) -> tuple[list[str], dict[str, str]]:
    """Apply :func:`should_quantize` to every (name, shape): (names to quantize, {kept name: reason})."""
    items = shapes.items() if isinstance(shapes, Mapping) else shapes
    quantized: list[str] = []
    kept: dict[str, str] = {}
    for name, shape in items:
        decision, reason = should_quantize(name, tuple(shape), group_size)
        if decision:
            quantized.append(name)
        else:
            kept[name] = reason
    return quantized, kept
