"""Padded batches that stay tight: requests of similar length together, within what padding costs on the device.

On an accelerator padded positions are nearly free until it is saturated; a CPU prefill is compute-bound, every
padded position costs as much as a real one and a padding mask moves attention off the unmasked causal kernel, so on
a CPU only equal lengths share a batch (docs/benchmarks.md, "Padded batches on a CPU").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PAD_WASTE = 1.5  # accelerators: a padded batch may cost at most 1.5× its rows' own tokens
CPU_PAD_WASTE = 1.0  # CPUs are compute-bound and padding is pure loss: only equal lengths share a batch


def split_by_length(costs: Sequence[float], waste: float = PAD_WASTE,
                    max_size: int | None = None, max_padded: float | None = None) -> list[list[int]]:
    """Indices grouped so that padding each group to its longest member costs at most ``waste``× its total.

    Sorted by cost (ties keep their order); a request joins the current group while the group has fewer than
    ``max_size`` members, ``size × its cost ≤ waste × the group's total`` and, with ``max_padded`` (a streamed
    backend's padded tokens per batch), ``size × its cost ≤ max_padded`` (a request alone may exceed it).
    """
    if waste < 1:
        raise ValueError(f"waste is a ratio of padded to real cost and must be ≥ 1, got {waste}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be ≥ 1, got {max_size}")
    if max_padded is not None and max_padded <= 0:
        raise ValueError(f"max_padded must be positive, got {max_padded}")
    groups: list[list[int]] = []
    total = 0.0
    for i in sorted(range(len(costs)), key=lambda k: costs[k]):
        current = groups[-1] if groups else None
        if (current is not None and (max_size is None or len(current) < max_size)
                and (max_padded is None or (len(current) + 1) * costs[i] <= max_padded)
                and (len(current) + 1) * costs[i] <= waste * (total + costs[i])):
            current.append(i)
            total += costs[i]
        else:
            groups.append([i])
            total = costs[i]
    return groups


def device_pad_waste(device: Any) -> float:
    """The padding a backend's device affords: :data:`CPU_PAD_WASTE` on a CPU, :data:`PAD_WASTE` elsewhere.

    ``device`` is whatever the backend holds (``torch.device``, an MLX device, or a string); MLX and torch both
    print ``cpu`` in their CPU devices' names.
    """
    return CPU_PAD_WASTE if "cpu" in str(device).lower() else PAD_WASTE
