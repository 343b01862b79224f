"""A request's attempt on one worker: the bookkeeping every flow (colocated, migration, P/D) shares.

``Attempts.on(worker, origin)`` waits the emulated round trip from the request's origin region to the
worker's (the router emulates WAN latency in the application), counts the request in the worker's
``inflight`` and ``sent`` and in the ``selected`` metric, and takes it out of ``inflight`` however the
attempt ends (answer, failure, cancellation). The flow says how it ended: ``succeeded`` closes the
worker's circuit breaker, ``failed`` counts a failure (and the ``breaker_opened`` metric when it opened it).
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from cluster.router.metrics import RouterMetrics
from cluster.router.regions import Topology
from cluster.router.view import WorkerInfo


class RouterClock(Protocol):
    """Emulated time (``actors.clock.Clock``, or a virtual clock in tests)."""

    time_scale: float

    def now_ms(self) -> float: ...

    async def sleep_for(self, duration_ms: float) -> float: ...


class Attempt:
    """One attempt's bookkeeping as an async context manager (a class: cheaper than a generator-based one,
    and this runs once per request and worker)."""

    __slots__ = ("attempts", "origin", "worker")

    def __init__(self, attempts: Attempts, worker: WorkerInfo, origin: str | None) -> None:
        self.attempts = attempts
        self.worker = worker
        self.origin = origin

    @property
    def waits(self) -> bool:
        """Whether entering waits an emulated round trip (other requests are decided meanwhile)."""
        return self.attempts.topology.rtt_ms(self.origin, self.worker.region) > 0

    async def __aenter__(self) -> WorkerInfo:
        a, w = self.attempts, self.worker
        rtt = a.topology.rtt_ms(self.origin, w.region)
        if rtt > 0:
            await a.clock.sleep_for(rtt)
        w.inflight += 1
        w.sent += 1
        a.metrics.selected.inc_labels(w.name)
        return w

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.worker.inflight -= 1


class Attempts:
    def __init__(self, metrics: RouterMetrics, topology: Topology, clock: RouterClock) -> None:
        self.metrics = metrics
        self.topology = topology
        self.clock = clock

    def wall_now(self) -> float:
        """Wall seconds on the router's clock (what breakers and health count in)."""
        return self.clock.now_ms() * self.clock.time_scale / 1000.0

    def on(self, worker: WorkerInfo, origin: str | None) -> Attempt:
        """``async with attempts.on(worker, origin):`` around everything the attempt does."""
        return Attempt(self, worker, origin)

    @staticmethod
    def succeeded(worker: WorkerInfo) -> None:
        worker.breaker.success()

    def failed(self, worker: WorkerInfo) -> None:
        if worker.breaker.failure(self.wall_now()):
            self.metrics.breaker_opened.inc_labels(worker.name)
