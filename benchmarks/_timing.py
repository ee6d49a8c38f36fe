"""Timing helpers shared by the benchmark scripts (run as scripts, so this folder is on sys.path)."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class ChildRun:
    """A command run to its end in a fresh process: exit status, wall seconds, the child's own peak RSS in bytes."""

    code: int
    wall_s: float
    peak_rss: int


def run_child(command: list[str], *, stderr: IO[Any], stdout: IO[Any] | None = None,
              env: Mapping[str, str] | None = None, cwd: Path | None = None) -> ChildRun:
    """``command`` in a fresh process, waited for with ``os.wait4``: the peak RSS is that child's own, not the
    largest of all children (``getrusage(RUSAGE_CHILDREN)``)."""
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(child.returncode, time.perf_counter() - started, usage.ru_maxrss * 1024)


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
