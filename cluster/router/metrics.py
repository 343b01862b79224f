"""The router's Prometheus metrics.

The per-request counters and the routing-latency histogram are bumped several times for every request
the router proxies. prometheus_client's own ``Counter`` takes a lock and walks a few layers of Python on
each ``inc`` (about 30 µs a request in all, measured with cProfile), so these are loop-local instead: an
increment is one dict update, and the registry reads the values at scrape time through prometheus_client's
custom-collector interface. They are not thread-safe, by design: the router touches them only from its
event loop. The exposition (names, ``_total`` suffix, labels, histogram buckets) is what the library's own
types produce.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class LoopCounter:
    """A counter family for one event loop (see the module's docstring)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        """Add to the unlabelled counter."""
        self.values[()] += amount

    def inc_labels(self, *labels: str, amount: float = 1.0) -> None:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels}")
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, v in list(self.values.items()):
            fam.add_metric(list(labels), v)
        yield fam


class LoopHistogram:
    """An unlabelled histogram for one event loop: ``observe`` is a bisect and two additions."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], *,
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = sorted(float(b) for b in buckets)
        if not self.bounds or self.bounds[-1] != float("inf"):
            self.bounds.append(float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        cumulative: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            total += n
            cumulative.append((floatToGoString(bound), float(total)))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=self.sum)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = LoopCounter("kvmesh_router_decisions", "Routing decisions by policy and reason.",
                                     ["policy", "reason"], registry=r)
        self.selected = LoopCounter("kvmesh_router_selected", "Requests sent to each worker.", ["worker"],
                                    registry=r)
        self.responses = LoopCounter("kvmesh_router_responses", "Responses by status code.", ["status"],
                                     registry=r)
        self.retries = LoopCounter("kvmesh_router_retries", "Attempts that moved to another worker.", ["reason"],
                                   registry=r)
        self.migrations = LoopCounter("kvmesh_router_migrations", "Streams moved to another worker mid-flight.",
                                      ["outcome"], registry=r)
        self.residency_rejections = LoopCounter("kvmesh_router_residency_rejections",
                                                "Requests refused because no worker in their residency region "
                                                "could serve them.", ["region"], registry=r)
        self.saturated = LoopCounter("kvmesh_router_saturated", "Requests refused with 429 (all workers full).",
                                     registry=r)
        self.cross_region = LoopCounter("kvmesh_router_cross_region", "Requests served outside their origin region.",
                                        ["origin", "served"], registry=r)
        self.predicted_hit_tokens = LoopCounter("kvmesh_router_predicted_prefix_hit_tokens",
                                                "Prompt tokens the index predicted the chosen worker holds.",
                                                registry=r)
        self.realized_hit_tokens = LoopCounter("kvmesh_router_realized_prefix_hit_tokens",
                                               "Prompt tokens the engines reported as prefix-cache hits.", registry=r)
        self.prompt_tokens = LoopCounter("kvmesh_router_prompt_tokens", "Prompt tokens routed.", registry=r)
        self.latency = LoopHistogram("kvmesh_router_routing_seconds", "Wall time to choose a worker.",
                                     (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2), registry=r)
        self.breaker_opened = LoopCounter("kvmesh_router_breaker_opened", "Circuit breakers opened.", ["worker"],
                                          registry=r)
        labels = ["worker", "region"]
        # Gauges are set at scrape time only, so the library's own type costs nothing per request.
        self.w_inflight = Gauge("kvmesh_router_worker_inflight", "Requests the router has open on a worker.",
                                labels, registry=r)
        self.w_running = Gauge("kvmesh_router_worker_running", "Running requests (engine report).", labels,
                               registry=r)
        self.w_waiting = Gauge("kvmesh_router_worker_waiting", "Waiting requests (engine report).", labels,
                               registry=r)
        self.w_kv = Gauge("kvmesh_router_worker_kv_usage", "KV cache usage (engine report).", labels, registry=r)
        self.w_healthy = Gauge("kvmesh_router_worker_healthy", "1 when the worker is eligible.", labels,
                               registry=r)
