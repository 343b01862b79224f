"""The router as a Ray actor, so it runs beside the engines rather than in the driver's event loop."""

from __future__ import annotations

from typing import Any

from cluster.router.app import RouterServer
from cluster.router.view import WorkerInfo


class RouterActor:
    def __init__(self, workers: dict[str, dict[str, Any]], policy: str, host: str = "127.0.0.1",
                 port: int = 0, request_timeout_s: float = 600.0) -> None:
        infos = [WorkerInfo.from_launch(n, d) for n, d in workers.items()]
        self.server = RouterServer(infos, policy, host=host, port=port, request_timeout_s=request_timeout_s)

    async def start(self) -> str:
        return await self.server.start()

    async def stats(self) -> dict[str, Any]:
        return self.server.stats()

    async def stop(self) -> None:
        await self.server.stop()
