"""Prometheus metrics for ``clef-local serve``, hand-written (text exposition format 0.0.4, no dependency).

Requests by route and status, request latency, batch sizes, inference time per batch and the scheduler's queue
depth. Routes are labelled by their template (``/v1/systemone``), never by the raw path, so a client cannot grow
the label set; anything that matched no route is ``other``.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Counter:
    """A monotonically increasing count per label set."""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        lines += [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]
        return lines


class Gauge:
    """A value read when scraped (``read`` is called then)."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = name, help_text, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_number(self.read())}"]


class Histogram:
    """Cumulative buckets, sum and count per label set."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float], labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.buckets = tuple(sorted(buckets))
        self._data: dict[tuple[str, ...], list[float]] = {}  # per bucket counts (not cumulative), then sum, count
        self._lock = threading.Lock()

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            row = self._data.setdefault(labels, [0.0] * (len(self.buckets) + 3))
            row[bisect.bisect_left(self.buckets, value)] += 1
            row[-2] += value
            row[-1] += 1

    def count(self, *labels: str) -> int:
        with self._lock:
            row = self._data.get(labels)
            return int(row[-1]) if row else 0

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._data.items())
        for key, row in items:
            running = 0.0
            for bound, n in zip((*self.buckets, math.inf), row, strict=False):
                running += n
                le = 'le="' + _number(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {_number(running)}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_number(row[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_number(row[-1])}")
        return lines


class ServerMetrics:
    """Every metric the server exports; ``queue_depth`` and ``in_flight`` are read from the scheduler."""

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0, in_flight: Callable[[], float] = lambda: 0,
                 ) -> None:
        self.requests = Counter("clef_requests_total", "HTTP requests answered, by route and status code.",
                                ("route", "status"))
        self.latency = Histogram("clef_request_duration_seconds", "HTTP request latency in seconds, by route.",
                                 LATENCY_BUCKETS, ("route",))
        self.bodies = Counter("clef_request_bodies_total", "POST bodies read, by Content-Encoding.", ("encoding",))
        self.batch_size = Histogram("clef_batch_size", "Requests per inference batch.", BATCH_BUCKETS)
        self.inference = Histogram("clef_batch_inference_seconds", "Time of one decide_batch call in seconds.",
                                   LATENCY_BUCKETS)
        self.queue_depth = Gauge("clef_queue_depth", "Requests waiting for the inference thread.", queue_depth)
        self.in_flight = Gauge("clef_requests_in_batch", "Requests in the batch being computed now.", in_flight)
        self.started = time.time()

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        uptime = Gauge("clef_uptime_seconds", "Seconds since the server started.", lambda: time.time() - self.started)
        lines: list[str] = []
        for metric in (self.requests, self.latency, self.bodies, self.batch_size, self.inference, self.queue_depth,
                       self.in_flight, uptime):
            lines += metric.render()
        return "\n".join(lines) + "\n"


class MetricsMiddleware:
    """ASGI middleware counting every HTTP response by route template and status, and timing it."""

    def __init__(self, app: Any, metrics: ServerMetrics, static_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.static_paths = frozenset(static_paths)  # plain routes (docs) that may not report a route object

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]  # what a crash before the response start would be

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is None:
                route = scope["path"] if scope.get("path") in self.static_paths else "other"
            route = str(route)
            self.metrics.requests.inc(route, str(status[0]))
            self.metrics.latency.observe(time.perf_counter() - started, route)
