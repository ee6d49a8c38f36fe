"""Is BF16 faster than float32 on this CPU? Measured once, not guessed from its flags (docs/hardware.md#the-loader).

The flags said the wrong thing both ways, and torch versions move the kernels, so :func:`measure` times a small
block's prefill matmuls in both dtypes, interleaved, and caches the result (``dtype_probe.json``) keyed by the CPU's
model name, flags and the torch version. ``dtype="auto"`` on a CPU follows it (:func:`~.choice.default_dtype`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from clef_local.planning.probe_cache import cached_entry, probe_file, store_entry

log = logging.getLogger(__name__)

PROBE_FILE = "dtype_probe.json"
# BF16 must beat float32 by this factor to be chosen: at a tie, float32's precision wins.
BF16_MARGIN = 1.1
# A prefill's shapes: 128 tokens through a 1024-wide block (MLP 1024 -> 2816 -> 1024 and an attention projection).
TOKENS, WIDTH, MLP = 128, 1024, 2816
REPEATS = 5


@dataclass(frozen=True)
class Bf16Probe:
    """One measurement: the best time of the probe's matmuls in each dtype, on the CPU and torch of ``key``."""

    key: str
    cpu: str
    torch: str
    float32_ms: float
    bfloat16_ms: float
    measured_at: str

    @property
    def speedup(self) -> float:
        """float32 time over BF16 time: above 1, BF16 is faster."""
        return self.float32_ms / self.bfloat16_ms

    @property
    def bf16_faster(self) -> bool:
        return self.speedup >= BF16_MARGIN

    def summary(self) -> str:
        return (f"bf16 {self.bfloat16_ms:.1f} ms vs float32 {self.float32_ms:.1f} ms ({self.speedup:.2f}x) on the "
                f"probe's prefill matmuls, torch {self.torch}, measured {self.measured_at[:10]}")


def torch_version() -> str | None:
    """The installed torch's version, without importing it."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_key(cpu_name: str, flags: tuple[str, ...] | list[str], torch: str) -> str:
    """What a measurement holds for: this CPU model with these flags, under this torch."""
    text = "\n".join([cpu_name, " ".join(sorted(flags)), torch])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure() -> tuple[float, float]:
    """(float32 ms, BF16 ms): the best of :data:`REPEATS` timings of the probe's matmuls in each dtype, the two
    interleaved so that a burst of load elsewhere on the machine hits both."""
    import torch

    generator = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in
            (("x", (TOKENS, WIDTH)), ("up", (MLP, WIDTH)), ("down", (WIDTH, MLP)), ("proj", (WIDTH, WIDTH)))}
    tensors = {dtype: {k: v.to(dtype) for k, v in base.items()} for dtype in (torch.float32, torch.bfloat16)}

    def run(t: dict[str, torch.Tensor]) -> float:
        started = time.perf_counter()
        h = torch.nn.functional.linear(t["x"], t["proj"])
        h = torch.nn.functional.gelu(torch.nn.functional.linear(h, t["up"]))
        torch.nn.functional.linear(h, t["down"])
        return 1e3 * (time.perf_counter() - started)

    best = {dtype: float("inf") for dtype in tensors}
    with torch.inference_mode():
        for dtype in tensors:  # warm-up: the first call of a kernel pays for its set-up
            run(tensors[dtype])
        for _ in range(REPEATS):
            for dtype in tensors:
                best[dtype] = min(best[dtype], run(tensors[dtype]))
    return best[torch.float32], best[torch.bfloat16]


def cached_probe(cpu_name: str, flags: tuple[str, ...], cache: Path | None = None) -> Bf16Probe | None:
    """The cached measurement for this CPU and the installed torch, or None (no torch, or not measured yet)."""
    version = torch_version()
    if version is None:
        return None
    entry = cached_entry(probe_file(PROBE_FILE, cache), probe_key(cpu_name, flags, version))
    try:
        return Bf16Probe(**entry) if isinstance(entry, dict) else None
    except TypeError:  # an entry written by another version of this module
        return None


def bf16_probe(cpu_name: str, flags: tuple[str, ...], cache: Path | None = None,
               run: Callable[[], tuple[float, float]] | None = None) -> Bf16Probe | None:
    """The cached measurement, or a new one (``run``, default :func:`measure`) written to the cache; None without
    torch. A cache that cannot be written is logged, not fatal: the measurement still answers this process."""
    if (found := cached_probe(cpu_name, flags, cache)) is not None:
        return found
    version = torch_version()
    if version is None:
        return None
    float32_ms, bfloat16_ms = (run or measure)()
    probe = Bf16Probe(key=probe_key(cpu_name, flags, version), cpu=cpu_name, torch=version,
                      float32_ms=round(float32_ms, 3), bfloat16_ms=round(bfloat16_ms, 3),
                      measured_at=datetime.now(UTC).isoformat(timespec="seconds"))
    log.info("measured this CPU once: %s", probe.summary())
    store_entry(probe_file(PROBE_FILE, cache), probe.key, asdict(probe), "the bf16 measurement")
    return probe
