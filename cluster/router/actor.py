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
    def __init__(self, workers: dict[str, dict[str, Any]], spec_json: str, residency_zone: str | None = None) -> None:
        restore_priority()
        spec = ClusterSpec.model_validate_json(spec_json)
        infos = [WorkerInfo.from_launch(n, d) for n, d in workers.items()]
        server = RouterServer(infos, spec.router, site=RouterSite.of(spec, residency_zone),
                              clock=Clock(spec.time_scale, spin_ms=0), rng=random.Random(spec.seed))
        self.server = server
        self.http = RouterHTTP(server, spec.router.host, spec.router.port if residency_zone is None else 0)

    async def start(self) -> str:
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
        await self.http.stop()
