"""A pipeline split of the decoder layers over several devices (``--device cuda:0,cuda:1``). Pure.

Consecutive runs of layers go to the devices in the order given, cut so that each device's share of the layer bytes
(:attr:`clef_local.planning.census.WeightCensus.layers`) is proportional to the memory it has left for them, which
leaves every device the same headroom; every device needs a whole prefill's activations. docs/hardware.md#two-cards.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clef_local.planning.census import WeightCensus
from clef_local.planning.estimate import MARGIN, RUNTIME_OVERHEAD, Activations, ModelDims, activations
from clef_local.planning.hardware import Hardware
from clef_local.units import GiB


@dataclass(frozen=True)
class Stage:
    """One device of a split: layers ``[start, stop)`` and its memory."""

    hardware: Hardware
    start: int
    stop: int
    layer_weights: int
    other_weights: int  # vision / embeddings on the first device, the norm, head, lm_head on the last
    activations: int
    overhead: int
    margin: int

    @property
    def weights(self) -> int:
        return self.layer_weights + self.other_weights

    @property
    def need(self) -> int:
        return self.weights + self.activations + self.overhead + self.margin

    @property
    def available(self) -> int:
        return self.hardware.free_bytes

    @property
    def fits(self) -> bool:
        return self.need <= self.available

    def to_json(self) -> dict[str, Any]:
        return {"device": self.hardware.device, "device_name": self.hardware.name, "layers": [self.start, self.stop],
                "layer_weight_bytes": self.layer_weights, "other_weight_bytes": self.other_weights,
                "activation_bytes": self.activations, "overhead_bytes": self.overhead, "margin_bytes": self.margin,
                "need_bytes": self.need, "available_bytes": self.available, "fits": self.fits}


@dataclass(frozen=True)
class SplitPlan:
    """A format's split over devices: one :class:`Stage` per device, in pipeline order."""

    fmt: str
    context: int
    batch: int
    dtype: str
    stages: tuple[Stage, ...]
    acts: Activations
    host_weights: int

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def ranges(self) -> tuple[tuple[str, int, int], ...]:
        """``(device, start, stop)`` per stage: what the torch backend places."""
        return tuple((s.hardware.device, s.start, s.stop) for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.fmt, "context": self.context, "batch": self.batch, "dtype": self.dtype,
                "fits": self.fits, "host_weight_bytes": self.host_weights,
                "stages": [s.to_json() for s in self.stages]}


def cut(layers: Sequence[int], budgets: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` ranges of ``layers`` (bytes each), one per budget, each non-empty, with each
    range's bytes as close as the layer boundaries allow to its budget's share of the total."""
    if len(budgets) > len(layers):
        raise ValueError(f"cannot split {len(layers)} layers over {len(budgets)} devices")
    total, weight = sum(layers), sum(max(b, 0) for b in budgets)
    shares = [max(b, 0) / weight if weight > 0 else 1 / len(budgets) for b in budgets]
    bounds, running, acc = [0], 0.0, 0
    prefix = [0]
    for size in layers:
        acc += size
        prefix.append(acc)
    for i, share in enumerate(shares[:-1]):
        running += share * total
        lo = bounds[-1] + 1  # at least one layer for this device
        hi = len(layers) - (len(budgets) - 1 - i)  # and one for each device after it
        best = min(range(lo, hi + 1), key=lambda k: (abs(prefix[k] - running), k))
        bounds.append(best)
    bounds.append(len(layers))
    return list(itertools.pairwise(bounds))


def split_plan(census: WeightCensus, dims: ModelDims, devices: Sequence[Hardware], *, context: int, batch: int = 1,
               dtype: str = "bfloat16", host_embeddings: bool = True, media: bool = False) -> SplitPlan:
    """The split of ``census``'s decoder layers over ``devices`` (module docstring); raises ValueError when the
    census has no per-layer bytes or there are more devices than layers."""
    if not census.layers:
        raise ValueError("the census has no per-layer bytes (a backbone without decoder layers?)")
    if len(devices) < 2:
        raise ValueError("a split needs at least two devices")
    acts = activations(dims, context, batch, dtype)
    first = (census.vision if media else 0) + (0 if host_embeddings else census.embed_tokens)
    last = census.text_rest + census.head + (0 if host_embeddings else census.lm_head)
    others = [first if i == 0 else 0 for i in range(len(devices))]
    others[-1] += last
    overheads = [RUNTIME_OVERHEAD[h.kind] for h in devices]
    budgets = [int((h.free_bytes - over) / (1 + MARGIN)) - acts.total - other
               for h, over, other in zip(devices, overheads, others, strict=True)]
    stages = []
    for hardware, (start, stop), other, over in zip(devices, cut(census.layers, budgets), others, overheads,
                                                     strict=True):
        weights = sum(census.layers[start:stop])
        stages.append(Stage(hardware, start, stop, weights, other, acts.total, over,
                            int(MARGIN * (weights + other + acts.total))))
    host = (census.embed_tokens + census.lm_head if host_embeddings else 0) + (0 if media else census.vision)
    return SplitPlan(census.fmt, context, batch, dtype, tuple(stages), acts, host)


def render_split(split: SplitPlan) -> list[str]:
    """The split as lines: one per device (layers, weights, activations, need vs available, verdict)."""
    g = lambda n: f"{n / GiB:.1f}"  # noqa: E731
    lines = [f"pipeline split of {split.fmt} over {len(split.stages)} devices at {split.context:,} tokens (hidden "
             f"states cross {len(split.stages) - 1} boundar{'y' if len(split.stages) == 2 else 'ies'}; GiB):"]
    for i, s in enumerate(split.stages):
        extra = ("" if not s.other_weights else f"; + final norm and head {g(s.other_weights)}"
                 if i == len(split.stages) - 1 else f"; + vision tower / embeddings {g(s.other_weights)}")
        lines.append(f"  {s.hardware.device} ({s.hardware.name}): layers {s.start}-{s.stop - 1} ({s.stop - s.start}) "
                     f"{g(s.layer_weights)}{extra}; activations {g(s.activations)}; overhead + margin "
                     f"{g(s.overhead + s.margin)}; need {g(s.need)} of {g(s.available)} → "
                     f"{'fits' if s.fits else 'does not fit'}")
    return lines
