"""Prometheus metrics for ``clef-local serve``, hand-written (text exposition format 0.0.4, no dependency); the list
is docs/serving.md#metrics. Routes are labelled by their template (``/v1/systemone``), never by the raw path, so a
client cannot grow the label set; anything that matched no route is ``other``.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
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


class Collected:
    """Values per label set read when scraped (``read`` returns ``[(label values, value), ...]``)."""

    def __init__(self, name: str, help_text: str, kind: str, labels: Sequence[str],
                 read: Callable[[], Iterable[tuple[tuple[str, ...], float]]]) -> None:
        self.name, self.help, self.kind, self.label_names, self.read = name, help_text, kind, tuple(labels), read

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        lines += [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in sorted(self.read())]
        return lines


# (metric, help, kind, CacheStats field per memory) of the state cache (clef_local.runtime.state_cache)
_CACHE_COUNTERS = (
    ("clef_state_cache_hits_total", "Records whose state came from the state cache (only their schema ran).", "hits"),
    ("clef_state_cache_misses_total", "State passes run because the state was not cached.", "misses"),
    ("clef_state_cache_evictions_total", "State cache entries dropped to stay within a budget.", "evictions"),
    ("clef_state_cache_memory_clears_total", "Times the state cache was emptied after a pass ran out of memory.",
     "memory_clears"),
)
_CACHE_GAUGES = (
    ("clef_state_cache_bytes", "Bytes held by the state cache.", ("bytes", "host_bytes")),
    ("clef_state_cache_budget_bytes", "The state cache's budget in bytes (0: off).", ("budget", "host_budget")),
    ("clef_state_cache_entries", "States held by the state cache.", ("entries", "host_entries")),
)


def state_cache_metrics(models: Callable[[], Mapping[str, Any]]) -> list[Collected]:
    """The state cache metrics of each served model that has one (``model.state_cache.stats()``), by model name;
    the byte gauges also by ``memory`` (``device``: the compute device, ``host``: entries spilled off a GPU)."""
    def stats() -> list[tuple[str, Any]]:
        return [(name, cache.stats()) for name, model in models().items()
                if (cache := getattr(model, "state_cache", None)) is not None]

    def counter(field: str) -> Callable[[], list[tuple[tuple[str, ...], float]]]:
        return lambda: [((name, ), float(getattr(s, field))) for name, s in stats()]

    def gauge(fields: tuple[str, str]) -> Callable[[], list[tuple[tuple[str, ...], float]]]:
        return lambda: [((name, memory), float(getattr(s, field))) for name, s in stats()
                        for memory, field in zip(("device", "host"), fields, strict=True)]

    return ([Collected(name, text, "counter", ("model",), counter(field)) for name, text, field in _CACHE_COUNTERS]
            + [Collected(name, text, "gauge", ("model", "memory"), gauge(fields))
               for name, text, fields in _CACHE_GAUGES])


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
        self.inference = Histogram("clef_batch_inference_seconds",
                                   "Time of one model group on the inference thread in seconds.", LATENCY_BUCKETS)
        self.queue_depth = Gauge("clef_queue_depth", "Requests waiting for the inference thread.", queue_depth)
        self.in_flight = Gauge("clef_requests_in_batch", "Requests in the batch being computed now.", in_flight)
        self.state_caches: list[Collected] = []
        self.started = time.time()

    def watch_state_caches(self, models: Mapping[str, Any]) -> None:
        """Export the state cache metrics of ``models`` (``{served name: ClefModel}``), read at each scrape."""
        self.state_caches = state_cache_metrics(lambda: models)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        uptime = Gauge("clef_uptime_seconds", "Seconds since the server started.", lambda: time.time() - self.started)
        lines: list[str] = []
        metrics: list[Counter | Histogram | Gauge | Collected] = [
            self.requests, self.latency, self.bodies, self.batch_size, self.inference, self.queue_depth,
            self.in_flight, *self.state_caches, uptime]
        for metric in metrics:
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
