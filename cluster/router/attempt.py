"""A request's attempt on one worker: the bookkeeping every flow (colocated, migration, P/D) shares.

``Attempts.on(worker, origin)`` waits the emulated round trip from the request's origin region to the
worker's (the router emulates WAN latency in the application), counts the request in the worker's
``inflight`` and ``sent`` and in the ``selected`` metric, and takes it out of ``inflight`` however the
attempt ends (answer, failure, cancellation). The flow says how it ended: ``succeeded`` closes the
worker's circuit breaker, ``failed`` counts a failure (and the ``breaker_opened`` metric when it opened it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

from cluster.router.metrics import RouterMetrics
from cluster.router.regions import Topology
from cluster.router.view import WorkerInfo


class RouterClock(Protocol):
    """Emulated time (``actors.clock.Clock``, or a virtual clock in tests)."""

    time_scale: float

    def now_ms(self) -> float: ...

    async def sleep_for(self, duration_ms: float) -> float: ...


class Attempts:
    def __init__(self, metrics: RouterMetrics, topology: Topology, clock: RouterClock) -> None:
        self.metrics = metrics
        self.topology = topology
        self.clock = clock

    def wall_now(self) -> float:
        """Wall seconds on the router's clock (what breakers and health count in)."""
        return self.clock.now_ms() * self.clock.time_scale / 1000.0

    @asynccontextmanager
    async def on(self, worker: WorkerInfo, origin: str | None) -> AsyncIterator[WorkerInfo]:
        rtt = self.topology.rtt_ms(origin, worker.region)
        if rtt > 0:
            await self.clock.sleep_for(rtt)
        worker.inflight += 1
        worker.sent += 1
        self.metrics.selected.inc_labels(worker.name)
        try:
            yield worker
        finally:
            worker.inflight -= 1

    @staticmethod
    def succeeded(worker: WorkerInfo) -> None:
        worker.breaker.success()

    def failed(self, worker: WorkerInfo) -> None:
        if worker.breaker.failure(self.wall_now()):
            self.metrics.breaker_opened.inc_labels(worker.name)
