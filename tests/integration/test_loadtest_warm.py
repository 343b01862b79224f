"""The warm keep-alive pool (cluster/loadtest/warm.py) against a real aiohttp server over real sockets: the
connections opened before a run carry a later burst of requests, so none of them connects first."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from cluster.loadtest.warm import open_warm

pytestmark = pytest.mark.integration


async def test_a_burst_after_warming_reuses_the_warm_connections() -> None:
    peers: list[tuple[str, object]] = []

    async def models(request: web.Request) -> web.Response:
        peers.append(("warm", request.transport.get_extra_info("peername") if request.transport else None))
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        peers.append(("send", request.transport.get_extra_info("peername") if request.transport else None))
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            assert await open_warm(session, f"http://127.0.0.1:{port}/", 6) == 6

            async def send() -> None:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{}") as resp:
                    await resp.read()

            await asyncio.gather(*(send() for _ in range(6)))  # a burst, all started in one loop pass
            assert await open_warm(session, "http://127.0.0.1:1/", 2) == 0  # refused: counted, not raised
    finally:
        await runner.cleanup()
    warm = {p for kind, p in peers if kind == "warm"}
    sent = {p for kind, p in peers if kind == "send"}
    assert len(warm) == 6  # six connections opened, one per concurrent GET
    assert len(sent) == 6 and sent <= warm  # the burst's six sends rode them, none connected anew
