"""Timing helper shared by the benchmark scripts (run as scripts, so this folder is on sys.path)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` runs after one warm-up (``sync`` waits for a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)
