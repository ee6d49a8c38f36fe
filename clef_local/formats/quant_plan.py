"""A mixed-precision variant's plan in ``config.json`` (docs/format.md §6, "Mixed precision").

``quantization_config.clef_local`` has ``"scheme": "mixed"`` and ``"layers"``: one entry per decoder layer of the
text model, ``{"0": {"scheme": "int4", "group_size": 32}, "1": {"scheme": "int8", "group_size": null}, …}``, where
``bf16`` means the layer's linear weights are kept as released. The loaders (torch: ``backends/quantized.py``; MLX:
``backends/mlx_weights.py``) check each quantized module's stored tensors against its layer's entry; ``plan`` and
``inspect`` group consecutive layers of one format (:func:`layer_groups`). How the plan is chosen:
docs/quantization.md#mixed-precision.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clef_local.errors import ReleaseError
from clef_local.quant import registry

MIXED = "mixed"
SOURCE = "bf16"  # a layer kept in the source precision (as released)
LAYER_SCHEMES = (*registry.SCHEMES, SOURCE)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerFormat:
    """One decoder layer's storage: a scheme of :data:`LAYER_SCHEMES` and, for int4 / nf4, its group size."""

    scheme: str
    group_size: int | None = None

    @property
    def label(self) -> str:
        """``int4 g32``, ``int8``, ``bf16``."""
        return self.scheme + (f" g{self.group_size}" if self.group_size else "")

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "group_size": self.group_size}


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor or module path belongs to (``…layers.N.…``), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def mixed_plan(config: Mapping[str, Any]) -> dict[int, LayerFormat] | None:
    """{layer index: format} of a mixed-precision variant's ``config.json``; None for any other release.
    :class:`ReleaseError` names what is wrong with a malformed plan."""
    quant = config.get("quantization_config")
    member = quant.get("clef_local") if isinstance(quant, Mapping) else None
    if not isinstance(member, Mapping) or member.get("scheme") != MIXED:
        return None
    layers = member.get("layers")
    where = "config.json: quantization_config.clef_local.layers"
    if not isinstance(layers, Mapping) or not layers:
        raise ReleaseError(f"{where} is missing; a mixed variant records each decoder layer's format there "
                           "(re-export it with clef-local quantize --format mixed)")
    plan: dict[int, LayerFormat] = {}
    for key, entry in layers.items():
        scheme = entry.get("scheme") if isinstance(entry, Mapping) else None
        group = entry.get("group_size") if isinstance(entry, Mapping) else None
        if not str(key).isdigit() or scheme not in LAYER_SCHEMES or not (group is None or isinstance(group, int)):
            raise ReleaseError(f"{where}[{key!r}] = {entry!r}: expected a layer index mapped to "
                               f"{{\"scheme\": one of {', '.join(LAYER_SCHEMES)}, \"group_size\": an integer or null}}")
        plan[int(key)] = LayerFormat(str(scheme), group)
    return dict(sorted(plan.items()))


def layer_groups(plan: Mapping[int, LayerFormat]) -> list[tuple[list[int], LayerFormat]]:
    """Consecutive layers of one format, in layer order: ``[([0, 1, 2, 3], int4 g32), ([4, 5], int8), …]``."""
    groups: list[tuple[list[int], LayerFormat]] = []
    for index, fmt in sorted(plan.items()):
        if groups and groups[-1][1] == fmt and groups[-1][0][-1] == index - 1:
            groups[-1][0].append(index)
        else:
            groups.append(([index], fmt))
    return groups


def span(layers: list[int]) -> str:
    """``0-3`` or ``7``."""
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
