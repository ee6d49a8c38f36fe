"""Streamed execution in numbers: a backbone run from its files a group of decoder layers at a time
(:mod:`clef_local.backends.streaming`), its peak memory, the bytes a pass reads and the time the reads take at a
measured rate (:mod:`clef_local.planning.read_probe`). Pure functions; the formula: docs/hardware.md#streamed-from-disk.

    peak = resident + two groups + transient + activations(batch) + overhead + margin

``resident``: what stays loaded for the whole run (the joint head in float32, the text model's weights outside the
decoder layers: the final norm; the vision tower when it fits); ``group``: the largest group of decoder layers as
loaded (in the compute dtype: a BF16 release computed in float32 doubles), two of them because the next group is
read while this one computes (a streamed vision tower is one more group: it runs while the first layers are read,
so two groups are ``max(2 · group, vision + group)``); ``transient``: one linear's weight in the compute dtype (a
quantized layer dequantizes per call, a cast holds both copies); ``embed_tokens`` and ``lm_head`` are never loaded:
a batch reads its rows from the file. A pass reads every decoder layer once, whatever the batch size, so a streamed
batch is as large as the memory left for activations allows (:attr:`StreamDecision.batch_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from clef_local.planning.census import WeightCensus
from clef_local.planning.estimate import DTYPE_SIZE, MARGIN, RUNTIME_OVERHEAD, Activations, ModelDims, activations
from clef_local.planning.hardware import Hardware
from clef_local.planning.read_probe import ReadRate
from clef_local.units import GiB

OFFLOAD_MODES = ("none", "auto", "disk")  # never stream / stream what does not fit resident / always stream
# a streamed batch reads every layer once, so padding costs less than another pass would: accelerators' budget
STREAM_PAD_WASTE = 1.5
MAX_BATCH_TOKENS = 1 << 16  # tokens of one streamed batch at most: progress stays visible, estimates stay near
GROUP_LAYERS = 1  # decoder layers per group: the smallest peak; the reads per pass do not depend on it


@dataclass(frozen=True)
class StreamDecision:
    """How the loader streams a backbone (the torch backend runs it; ``ClefModel.describe()`` shows it)."""

    group_layers: int
    vision: str  # "resident", "streamed" (one more group, on passes with media) or "none"
    batch_tokens: int  # padded tokens per batch (ClefModel.run cuts batches at this)
    pad_waste: float
    peak_bytes: int  # at a batch of batch_tokens
    available_bytes: int
    read_bytes: int  # stored bytes of the decoder layers: what every pass reads
    need_bytes: int = 0  # one record at the full context: what must fit (the verdict)
    vision_read_bytes: int = 0  # what a pass with media reads more when the vision tower is streamed
    read_rate: float | None = None  # bytes/s (None: not measured yet)
    read_rate_source: str = ""
    prefetch: bool = True

    @property
    def read_seconds(self) -> float | None:
        """Estimated seconds a pass spends reading (at :attr:`read_rate`)."""
        return self.read_bytes / self.read_rate if self.read_rate else None

    def summary(self) -> str:
        """"peak 5.1 GiB, reads 18.8 GB per pass (~9 s at 2.1 GB/s, measured ...)"."""
        seconds = self.read_seconds
        timing = (f" (~{seconds:,.0f} s at {self.read_rate / 1e9:.1f} GB/s, {self.read_rate_source})"
                  if seconds is not None and self.read_rate else "")
        return f"peak {self.peak_bytes / GiB:.1f} GiB, reads {self.read_bytes / 1e9:.1f} GB per pass{timing}"


@dataclass(frozen=True)
class StreamPlan:
    """One format streamed on one device: the terms of the peak, the reads, the verdict."""

    fmt: str
    hardware: Hardware
    context: int
    dtype: str
    resident: int
    group: int
    group_layers: int
    vision: str  # "resident", "streamed" or "none"
    vision_group: int  # the streamed vision tower's bytes as loaded (0 unless streamed)
    transient: int
    activations: Activations  # one record at the full context: what must fit
    overhead: int
    read_bytes: int
    vision_read_bytes: int
    batch_tokens: int
    batch_activations: int  # activations of a batch of batch_tokens
    read_rate: ReadRate | None = None

    @property
    def groups(self) -> int:
        """Bytes of the groups loaded at once: this one and the next (or the vision tower and the first)."""
        return max(2 * self.group, self.vision_group + self.group)

    def _total(self, acts: int) -> int:
        held = self.resident + self.groups + acts
        return held + self.transient + self.overhead + int(MARGIN * held)

    @property
    def need(self) -> int:
        """Bytes for one record at the full context: what the verdict is about."""
        return self._total(self.activations.total)

    @property
    def peak(self) -> int:
        """Bytes at a batch of :attr:`batch_tokens` (what a run may reach)."""
        return self._total(max(self.activations.total, self.batch_activations))

    @property
    def available(self) -> int:
        return self.hardware.free_bytes

    @property
    def fits(self) -> bool:
        host = self.hardware.shares_host_memory or self.group <= self.hardware.host_free_bytes
        return self.need <= self.available and host

    @property
    def read_seconds(self) -> float | None:
        return self.read_bytes / self.read_rate.bytes_per_second if self.read_rate else None

    def decision(self) -> StreamDecision:
        return StreamDecision(group_layers=self.group_layers, vision=self.vision, batch_tokens=self.batch_tokens,
                              pad_waste=STREAM_PAD_WASTE, peak_bytes=self.peak, available_bytes=self.available,
                              need_bytes=self.need,
                              read_bytes=self.read_bytes, vision_read_bytes=self.vision_read_bytes,
                              read_rate=self.read_rate.bytes_per_second if self.read_rate else None,
                              read_rate_source=self.read_rate.source if self.read_rate else "")

    def to_json(self) -> dict[str, Any]:
        return {"format": self.fmt, "device": self.hardware.device, "context": self.context, "dtype": self.dtype,
                "resident_bytes": self.resident, "group_bytes": self.group, "group_layers": self.group_layers,
                "groups_bytes": self.groups, "vision": self.vision, "vision_group_bytes": self.vision_group,
                "transient_bytes": self.transient,
                "activation_bytes": self.activations.total, "overhead_bytes": self.overhead,
                "need_bytes": self.need, "peak_bytes": self.peak, "batch_tokens": self.batch_tokens,
                "read_bytes_per_pass": self.read_bytes, "vision_read_bytes": self.vision_read_bytes,
                "read_rate": self.read_rate.bytes_per_second if self.read_rate else None,
                "read_rate_source": self.read_rate.source if self.read_rate else None,
                "read_seconds_per_pass": self.read_seconds, "available_bytes": self.available, "fits": self.fits}


def loaded_growth(census: WeightCensus, dtype: str) -> float:
    """Bytes of a decoder layer as loaded over its stored bytes: the floating tensors cast to the compute dtype
    (a quantized layer's packed tensors stay as stored)."""
    ratio = DTYPE_SIZE[dtype] / census.float_bytes
    if census.fmt == "bf16":
        return ratio
    text = census.quantized_linears + census.text_other
    return (census.quantized_linears + census.text_other * ratio) / text if text else 1.0


def groups_of(layers: int, group_layers: int) -> list[range]:
    """Consecutive groups of ``group_layers`` decoder layers (the last may be shorter)."""
    if group_layers < 1:
        raise ValueError(f"a group holds at least one layer, not {group_layers}")
    return [range(start, min(start + group_layers, layers)) for start in range(0, layers, group_layers)]


def stream_plan(census: WeightCensus, dims: ModelDims, hardware: Hardware, *, context: int, dtype: str = "bfloat16",
                media: bool = True, group_layers: int = GROUP_LAYERS, read_rate: ReadRate | None = None,
                vision: str | None = None) -> StreamPlan:
    """The streamed plan of ``census`` on ``hardware`` at ``context`` tokens. ``media``: the vision tower runs
    (resident when the plan fits with it, else streamed as one more group; ``vision`` forces one). The batch budget
    is the most padded tokens (a multiple of ``context``, at most :data:`MAX_BATCH_TOKENS` or one context) whose
    activations fit what is left."""
    if dtype not in DTYPE_SIZE:
        raise ValueError(f"unknown compute dtype {dtype!r}; use one of {', '.join(DTYPE_SIZE)}")
    growth = loaded_growth(census, dtype)
    layer_bytes = list(census.layers) or [census.quantized_linears + census.text_other]
    group = max(int(sum(layer_bytes[i] for i in g) * growth) for g in groups_of(len(layer_bytes), group_layers))
    d = DTYPE_SIZE[dtype]
    transient = dims.hidden * max(dims.intermediate, dims.heads * dims.head_dim * 2) * d
    base_resident = census.head + int(max(0, census.text_rest) * growth)
    vision_bytes = int(census.vision * (d / census.float_bytes)) if media else 0
    one = activations(dims, context, 1, dtype)
    overhead = RUNTIME_OVERHEAD[hardware.kind]

    def build(mode: str) -> StreamPlan:
        resident = base_resident + (vision_bytes if mode == "resident" else 0)
        plan = StreamPlan(fmt=census.fmt, hardware=hardware, context=context, dtype=dtype, resident=resident,
                          group=group, group_layers=group_layers, vision=mode,
                          vision_group=vision_bytes if mode == "streamed" else 0, transient=transient, activations=one,
                          overhead=overhead, read_bytes=sum(layer_bytes),
                          vision_read_bytes=census.vision if mode == "streamed" else 0, batch_tokens=context,
                          batch_activations=one.total, read_rate=read_rate)
        return _with_batch(plan, dims)

    if not vision_bytes:
        return build("none")
    if vision is not None:
        return build(vision)
    resident = build("resident")
    return resident if resident.fits else build("streamed")


def _with_batch(plan: StreamPlan, dims: ModelDims) -> StreamPlan:
    """``plan`` with the largest batch budget whose peak fits (one context when nothing more does)."""
    most = max(1, max(MAX_BATCH_TOKENS, plan.context) // plan.context)
    best = replace(plan, batch_tokens=plan.context, batch_activations=plan.activations.total)
    lo, hi = 1, most
    while lo < hi:  # peak grows with the records per batch: the largest that fits
        mid = (lo + hi + 1) // 2
        candidate = replace(plan, batch_tokens=mid * plan.context,
                            batch_activations=activations(dims, plan.context, mid, plan.dtype).total)
        if candidate.peak <= plan.available:
            lo, best = mid, candidate
        else:
            hi = mid - 1
    return best


def render_streamed(plans: dict[str, StreamPlan]) -> list[str]:
    """The ``plan`` table of the streamed formats (GiB; reads in GB)."""
    any_plan = next(iter(plans.values()))
    rate = any_plan.read_rate
    lines = [f"streamed from disk (decoder layers read a group at a time, embeddings gathered from the files; reads at "
             f"{rate.summary() if rate else 'an unmeasured rate'}):",
             f"{'format':<7}{'resident':>9}{'2 groups':>9}{'activ.':>8}{'need':>7}{'peak':>7}{'batch tok':>10}"
             f"{'reads/pass':>11}{'read time':>10}  verdict"]
    for fmt, p in plans.items():
        seconds = p.read_seconds
        lines.append(f"{fmt:<7}{p.resident / GiB:>9.1f}{p.groups / GiB:>9.1f}{p.activations.total / GiB:>8.1f}"
                     f"{p.need / GiB:>7.1f}{p.peak / GiB:>7.1f}{p.batch_tokens:>10,}{p.read_bytes / 1e9:>9.1f}GB"
                     f"{(f'{seconds:,.0f} s' if seconds is not None else '—'):>10}  "
                     f"{'streams' if p.fits else 'does not fit'}")
    return lines
