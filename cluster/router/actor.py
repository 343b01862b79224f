"""The router as a Ray actor, so it runs beside the engines rather than in the driver's event loop."""

from __future__ import annotations

import os
from typing import Any

from actors.worker import freeze_heap, restore_priority
from cluster.router.app import RouterServer, RouterSettings
from cluster.router.view import WorkerInfo
from config.cluster import ClusterSpec


def settings_from_spec(spec: ClusterSpec, residency_zone: str | None = None) -> RouterSettings:
    r = spec.router
    regions = [x.name for x in spec.regions]
    rtt = {(a, b): spec.rtt_ms(a, b) for i, a in enumerate(regions) for b in regions[i + 1:]}
    return RouterSettings(policy=r.policy, policy_params=dict(r.policy_params), region_strategy=r.region_strategy,
                          region=residency_zone or r.region, residency_zone=residency_zone,
                          max_attempts=r.max_attempts, request_timeout_s=r.request_timeout_s,
                          time_scale=spec.time_scale, rtt_ms=rtt, max_waiting=r.max_waiting,
                          index_mode=r.index_mode, migrate=r.migrate, seed=spec.seed,
                          disagg=spec.disagg if spec.disaggregated else None)


class RouterActor:
    def __init__(self, workers: dict[str, dict[str, Any]], spec_json: str, residency_zone: str | None = None) -> None:
        restore_priority()
        spec = ClusterSpec.model_validate_json(spec_json)
        infos = [WorkerInfo.from_launch(n, d) for n, d in workers.items()]
        self.server = RouterServer(infos, settings_from_spec(spec, residency_zone), host=spec.router.host,
                                   port=spec.router.port if residency_zone is None else 0)

    async def start(self) -> str:
        url = await self.server.start()
        freeze_heap()
        return url

    async def pid(self) -> int:
        return os.getpid()

    async def stats(self) -> dict[str, Any]:
        return self.server.stats()

    async def stop(self) -> None:
        await self.server.stop()
