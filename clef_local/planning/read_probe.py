"""How fast this machine reads a release's weight files: measured once per filesystem, cached, for the time a streamed
pass spends reading (:mod:`clef_local.planning.stream`; docs/hardware.md#streamed-from-disk).

:func:`measure` reads the first :data:`PROBE_BYTES` of a weight file in :data:`BLOCK` reads, after asking the kernel
to drop that range from its page cache (``posix_fadvise(DONTNEED)``, where there is one: a cached file reads at
memory speed and says nothing about the disk), and caches the rate (``read_probe.json`` in the user cache) keyed by
this machine and the file's filesystem (its device number). A file shorter than :data:`MIN_BYTES` gives a rough rate
that is used but not cached. ``plan --config`` (no files here) takes ``--read-rate`` or :data:`ASSUMED_RATE`.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from clef_local import units
from clef_local.planning.probe_cache import cached_entry, probe_file, store_entry

log = logging.getLogger(__name__)

PROBE_FILE = "read_probe.json"
PROBE_BYTES = 256 << 20
MIN_BYTES = 64 << 20
BLOCK = 8 << 20
ASSUMED_RATE = 2e9  # bytes/s: a PCIe 3 NVMe SSD's sequential read, for desks that are not this one


@dataclass(frozen=True)
class ReadRate:
    """Bytes per second that weight files read at, and where the number comes from."""

    bytes_per_second: float
    source: str  # "measured on ... <date>", "given (--read-rate)", "assumed ..."

    def summary(self) -> str:
        return f"{self.bytes_per_second / 1e9:.2f} GB/s, {self.source}"


def assumed() -> ReadRate:
    return ReadRate(ASSUMED_RATE, f"assumed ({ASSUMED_RATE / 1e9:.0f} GB/s, an NVMe SSD; --read-rate sets it)")


def given(text: str) -> ReadRate:
    """``--read-rate 3GB`` / ``3GB/s`` / ``500MB``: bytes per second (:func:`clef_local.units.parse_size`)."""
    rate = units.parse_size(text.removesuffix("/s"), what="the read rate")
    if rate <= 0:
        raise ValueError(f"a read rate must be positive, not {text!r} (e.g. --read-rate 3GB/s)")
    return ReadRate(float(rate), "given (--read-rate)")


def probe_key(path: Path) -> str:
    """This machine and the filesystem ``path`` lies on."""
    return f"{platform.node()}:{os.stat(path).st_dev}"


def measure(path: Path, limit: int = PROBE_BYTES) -> tuple[float, int]:
    """(bytes per second, bytes read) over the first ``limit`` bytes of ``path``, cache dropped first where the OS
    allows."""
    size = min(limit, path.stat().st_size)
    buffer = bytearray(min(BLOCK, max(size, 1)))
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        fadvise = getattr(os, "posix_fadvise", None)
        if fadvise is not None:
            fadvise(f.fileno(), 0, size, os.POSIX_FADV_DONTNEED)
        done = 0
        started = time.perf_counter()
        while done < size:
            got = f.readinto(view[: min(len(view), size - done)])
            if not got:
                break
            done += got
        seconds = time.perf_counter() - started
    return (done / seconds if seconds > 0 else float("inf")), done


def read_rate(file: Path, cache: Path | None = None) -> ReadRate:
    """The cached rate of ``file``'s filesystem, or a new measurement on ``file`` (cached when it read at least
    :data:`MIN_BYTES`). A cache that cannot be written is logged, not fatal."""
    key = probe_key(file)
    path = probe_file(PROBE_FILE, cache)
    entry = cached_entry(path, key)
    if isinstance(entry, dict) and isinstance(entry.get("bytes_per_second"), int | float):
        return ReadRate(float(entry["bytes_per_second"]), f"measured {str(entry.get('measured_at', ''))[:10]}, cached")
    rate, done = measure(file)
    if done < MIN_BYTES:
        return ReadRate(rate, f"measured on {units.format_size(done)} only (rough, not cached)")
    measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    log.info("measured this disk's read rate once: %.2f GB/s over %s of %s", rate / 1e9, units.format_size(done), file)
    store_entry(path, key, {"bytes_per_second": round(rate), "measured_at": measured_at, "file": str(file),
                            "bytes": done}, "the read rate")
    return ReadRate(rate, f"measured {measured_at[:10]}")

