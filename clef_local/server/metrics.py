"""Prometheus metrics for ``clef-local serve`` through ``prometheus_client``, in one registry per app (never the
process-wide default, so two apps in a process, or the tests' many, do not share counts); the list is
docs/serving.md#metrics. Routes are labelled by their template (``/v1/systemone``), never by the raw path, so a
client cannot grow the label set; anything that matched no route is ``other``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes

# (metric, help, CacheStats field) of the state cache (clef_local.runtime.state_cache), counters by model
_CACHE_COUNTERS = (
    ("clef_state_cache_hits_total", "Records whose state came from the state cache (only their schema ran).", "hits"),
    ("clef_state_cache_misses_total", "State passes run because the state was not cached.", "misses"),
    ("clef_state_cache_evictions_total", "State cache entries dropped to stay within a budget.", "evictions"),
    ("clef_state_cache_memory_clears_total", "Times the state cache was emptied after a pass ran out of memory.",
     "memory_clears"),
)
# (metric, help, (device field, host field)), gauges by model and memory
_CACHE_GAUGES = (
    ("clef_state_cache_bytes", "Bytes held by the state cache.", ("bytes", "host_bytes")),
    ("clef_state_cache_budget_bytes", "The state cache's budget in bytes (0: off).", ("budget", "host_budget")),
    ("clef_state_cache_entries", "States held by the state cache.", ("entries", "host_entries")),
)


class StateCacheCollector:
    """The state cache metrics of each served model that has one (``model.state_cache.stats()``), read at each
    scrape, by model name; the byte gauges also by ``memory`` (``device``: the compute device, ``host``: entries
    spilled off a GPU)."""

    def __init__(self, models: Callable[[], Mapping[str, Any]] = dict) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        stats = [(name, cache.stats()) for name, model in self.models().items()
                 if (cache := getattr(model, "state_cache", None)) is not None]
        for metric, text, field in _CACHE_COUNTERS:
            counter = CounterMetricFamily(metric, text, labels=("model",))
            for name, s in stats:
                counter.add_metric((name,), float(getattr(s, field)))
            yield counter
        for metric, text, fields in _CACHE_GAUGES:
            gauge = GaugeMetricFamily(metric, text, labels=("model", "memory"))
            for name, s in stats:
                for memory, field in zip(("device", "host"), fields, strict=True):
                    gauge.add_metric((name, memory), float(getattr(s, field)))
            yield gauge


class WithoutCreated:
    """``metrics`` as one collector, less their ``_created`` samples: prometheus_client adds a creation-time series
    to each counter and histogram, which this server's metric list does not have (turning it off in the library is
    process-wide: ``disable_created_metrics``)."""

    def __init__(self, metrics: Iterable[Any]) -> None:
        self.metrics = tuple(metrics)

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            for family in metric.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


class ServerMetrics:
    """Every metric the server exports; ``queue_depth`` and ``in_flight`` are read from the scheduler."""

    def __init__(self, queue_depth: Callable[[], float] = lambda: 0, in_flight: Callable[[], float] = lambda: 0,
                 ) -> None:
        self.registry = CollectorRegistry()
        # registry=None: registered below, once, through WithoutCreated
        self.requests = Counter("clef_requests_total", "HTTP requests answered, by route and status code.",
                                ("route", "status"), registry=None)
        self.latency = Histogram("clef_request_duration_seconds", "HTTP request latency in seconds, by route.",
                                 ("route",), buckets=LATENCY_BUCKETS, registry=None)
        self.bodies = Counter("clef_request_bodies_total", "POST bodies read, by Content-Encoding.", ("encoding",),
                              registry=None)
        self.batch_size = Histogram("clef_batch_size", "Requests per inference batch.", buckets=BATCH_BUCKETS,
                                    registry=None)
        self.inference = Histogram("clef_batch_inference_seconds",
                                   "Time of one model group on the inference thread in seconds.",
                                   buckets=LATENCY_BUCKETS, registry=None)
        self.started = time.time()
        gauges = []
        for name, text, read in (
                ("clef_queue_depth", "Requests waiting for the inference thread.", queue_depth),
                ("clef_requests_in_batch", "Requests in the batch being computed now.", in_flight),
                ("clef_uptime_seconds", "Seconds since the server started.", lambda: time.time() - self.started)):
            gauge = Gauge(name, text, registry=None)
            gauge.set_function(read)
            gauges.append(gauge)
        self.state_caches = StateCacheCollector()
        self.registry.register(WithoutCreated([self.requests, self.latency, self.bodies, self.batch_size,
                                               self.inference, *gauges]))
        self.registry.register(self.state_caches)

    def watch_state_caches(self, models: Mapping[str, Any]) -> None:
        """Export the state cache metrics of ``models`` (``{served name: ClefModel}``), read at each scrape."""
        self.state_caches.models = lambda: models

    def sample(self, name: str, **labels: str) -> float:
        """One sample's value (``sample("clef_requests_total", route="/health", status="200")``), 0 when it has
        not been observed."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return generate_latest(self.registry).decode()


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
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
