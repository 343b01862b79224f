"""The router as a Ray actor, so it runs beside the engines rather than in the driver's event loop."""

from __future__ import annotations

import os
import random
from typing import Any

from actors.clock import Clock
from actors.worker import freeze_heap, restore_priority
from cluster.router.app import RouterServer, RouterSite
from cluster.router.view import WorkerInfo
from cluster.router.web import RouterHTTP
from config.cluster import ClusterSpec


class RouterActor:
    """One router process. ``workers`` may come later, with ``start``: a launch creates the actor while the
    engines are still starting, so the process start-up and imports (a second or more per actor) overlap
    theirs instead of following them."""

    def __init__(self, workers: dict[str, dict[str, Any]] | None, spec_json: str,
                 residency_zone: str | None = None) -> None:
        restore_priority()
        self.spec = ClusterSpec.model_validate_json(spec_json)
        self.zone = residency_zone
        if workers is not None:
            self._build(workers)

    def _build(self, workers: dict[str, dict[str, Any]]) -> None:
        spec = self.spec
        infos = [WorkerInfo.from_launch(n, d) for n, d in workers.items()]
        server = RouterServer(infos, spec.router, site=RouterSite.of(spec, self.zone),
                              clock=Clock(spec.time_scale, spin_ms=0), rng=random.Random(spec.seed))
        self.server = server
        self.http = RouterHTTP(server, spec.router.host, spec.router.port if self.zone is None else 0)

    async def start(self, workers: dict[str, dict[str, Any]] | None = None) -> str:
        """Listen and return the URL; ``workers`` here when the constructor had none (exactly one of the two)."""
        if (workers is not None) == hasattr(self, "server"):
            raise ValueError("the router's workers come with the constructor or with start, exactly once")
        if workers is not None:
            self._build(workers)
        url = await self.http.start()
        freeze_heap()
        return url

    async def pid(self) -> int:
        return os.getpid()

    async def stats(self) -> dict[str, Any]:
        return self.server.stats()

    async def indexed_hashes(self) -> dict[str, list[int]]:
        """What the prefix index holds for each worker (chaos runs check it converged to the engines')."""
        index = self.server.chooser.index
        return {name: sorted(index.hashes_of(name)) for name in self.server.view.workers}

    async def shutdown(self, wait_s: float = 10.0) -> int:
        """A graceful stop: every request in flight ends with a 503 (an error event and ``[DONE]`` on a begun
        stream), new ones are refused, then the server stops listening. Returns how many were ended."""
        ended = await self.server.end_requests(wait_s)
        await self.http.stop()
        return ended

    async def stop(self) -> None:
        if hasattr(self, "http"):  # a launch that failed before ``start`` stops a router that never listened
            await self.http.stop()
