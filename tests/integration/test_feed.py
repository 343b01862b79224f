"""The engines' push feed on a real WebSocket: snapshot first, numbered KV batches, loads that keep coming
while an engine changes and KV events stream without pause, silence but for beats while idle, several
engines of one process on one connection (sub/unsub/gone), resync on request, garbage refused; and the
router's client over it: every worker up from one connection, a drain learned at once, all down when the
process goes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from actors.clock import Clock
from actors.cost_model import EmpiricalCostModel
from actors.engine.engine import Engine, EngineConfig
from actors.engine.kv_blocks import BlockHash, BlockStored
from actors.engine.scheduler import SchedulerLimits
from actors.feed import FeedHub
from actors.http import serve_app
from actors.metrics import EngineMetrics
from actors.server import EngineServer
from cluster.router.feed import FeedClient
from cluster.router.prefix_index import PrefixIndex
from cluster.router.view import ClusterView, RoutingConfig, WorkerId, WorkerInfo
from config import default_catalog
from config.cluster import FeedSpec

LESSON = default_catalog().profiles.get("lesson-70b-fp8")


def make_engine(name: str) -> Engine:
    cfg = EngineConfig(name, "lesson", "colocated", 1024, 16, SchedulerLimits(64, 8192, 100_000))
    return Engine(cfg, EmpiricalCostModel(LESSON, "colocated"), Clock(0.02, spin_ms=0.2))


def unpack(msg: aiohttp.WSMessage) -> list[dict[str, Any]]:
    obj = msgpack.unpackb(msg.data, strict_map_key=False)
    return list(obj["f"]) if obj["t"] == "batch" else [obj]


async def serve_hub(hub: FeedHub, default: tuple[str, ...]) -> tuple[web.AppRunner, int]:
    app = web.Application()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        return await hub.serve(request, default)

    app.router.add_get("/feed", handler)
    return await serve_app(app, "127.0.0.1", 0)


async def test_loads_continue_under_a_steady_stream_of_kv_events() -> None:
    eng = make_engine("e0")
    changes = 0

    def load() -> dict[str, int]:
        return {"running": 0, "waiting": changes}

    hub = FeedHub(FeedSpec(load_interval_ms=40.0, heartbeat_ms=500.0))
    hub.add("e0", eng, load)
    runner, port = await serve_hub(hub, ("e0",))
    frames: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/feed") as ws:
            first = unpack(await ws.receive())[0]
            assert first["t"] == "snapshot" and first["e"] == "e0" and first["seq"] == 0

            async def events() -> None:  # a KV batch and a load change every 10 ms for 0.4 s
                nonlocal changes
                for seq in range(1, 41):
                    hub._on_kv("e0", seq, [BlockStored((BlockHash(seq),), None, 16)])
                    changes += 1
                    hub.changed("e0")
                    await asyncio.sleep(0.01)

            producer = asyncio.create_task(events())
            async with asyncio.timeout(10):
                while not any(f["t"] == "kv" and f["seq"] == 40 for f in frames):
                    frames.extend(unpack(await ws.receive()))
            await producer
            await ws.send_bytes(msgpack.packb({"t": "resync", "e": "e0"}))
            async with asyncio.timeout(10):
                while (got := unpack(await ws.receive())) and got[0]["t"] != "snapshot":
                    frames.extend(got)
            await ws.send_bytes(b"\xc1 not msgpack")
            async with asyncio.timeout(2):
                while (closing := await ws.receive()).type == aiohttp.WSMsgType.BINARY:
                    pass
            assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and ws.close_code == 1003
    finally:
        await runner.cleanup()
    kv = [f["seq"] for f in frames if f["t"] == "kv"]
    assert kv == list(range(1, 41))
    loads = [f["loads"]["e0"]["waiting"] for f in frames if f["t"] == "load"]
    assert len(loads) >= 5  # 0.4 s of changes at one load frame per 40 ms, with slack
    assert loads == sorted(loads) and len(set(loads)) == len(loads)  # only changed reports, in order


async def test_an_idle_engine_sends_beats_only() -> None:
    eng = make_engine("e0")
    calls = 0

    def load() -> dict[str, int]:
        nonlocal calls
        calls += 1
        return {"running": 0}

    hub = FeedHub(FeedSpec(heartbeat_ms=50.0))
    hub.add("e0", eng, load)
    runner, port = await serve_hub(hub, ("e0",))
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/feed") as ws:
            assert unpack(await ws.receive())[0]["t"] == "snapshot"
            hub.changed("e0")  # a change that leaves the report as it was sends nothing
            kinds = [f["t"] for _ in range(4) for f in unpack(await asyncio.wait_for(ws.receive(), 5))]
    finally:
        await runner.cleanup()
    assert kinds == ["beat"] * 4
    assert calls == 2  # the snapshot's report and the one compared after the change; beats read nothing


async def test_one_connection_carries_every_engine_of_a_process() -> None:
    hub = FeedHub()
    engines = [make_engine(n) for n in ("a", "b")]
    for e in engines:
        hub.add(e.cfg.name, e, (lambda who: lambda: {"running": 0, "who": who})(e.cfg.name))
    runner, port = await serve_hub(hub, ("b",))  # as if reached through b's server
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/feed?engines=") as ws:
            await ws.send_bytes(msgpack.packb({"t": "sub", "e": ["a", "b", "ghost"]}))
            got = unpack(await asyncio.wait_for(ws.receive(), 5))
            assert [(f["t"], f["e"]) for f in got] == [("snapshot", "a"), ("snapshot", "b"), ("gone", "ghost")]
            assert got[1]["load"] == {"running": 0, "who": "b"}
            hub._on_kv("b", 1, [BlockStored((BlockHash(7),), None, 16)])
            got = unpack(await asyncio.wait_for(ws.receive(), 5))
            assert [(f["t"], f["e"], f["seq"]) for f in got] == [("kv", "b", 1)]
            await ws.send_bytes(msgpack.packb({"t": "unsub", "e": ["b"]}))
            await asyncio.sleep(0.05)
            hub._on_kv("b", 2, [BlockStored((BlockHash(8),), None, 16)])  # not carried any more
            hub.remove("a")
            got = unpack(await asyncio.wait_for(ws.receive(), 5))
            assert [(f["t"], f["e"]) for f in got] == [("gone", "a")]
    finally:
        await runner.cleanup()


async def test_the_router_sees_every_engine_of_a_process_over_one_connection() -> None:
    hub = FeedHub(FeedSpec(heartbeat_ms=100.0))
    servers = []
    for n in ("a", "b"):
        e = make_engine(n)
        servers.append(EngineServer(e, EngineMetrics("lesson", n), hub=hub))
    urls = [await s.start() for s in servers]
    workers = [WorkerInfo(WorkerId(n), u, extra={"feed_url": urls[0]}) for n, u in zip("ab", urls, strict=True)]
    view = ClusterView(workers, RoutingConfig(health_timeout_s=2.0))
    index = PrefixIndex()
    async with aiohttp.ClientSession() as session:
        client = FeedClient(urls[0], index, session, time.monotonic)
        for w in workers:
            await client.add(w)
        client.start()
        try:
            async with asyncio.timeout(10):
                while not all(view.healthy(w) for w in workers):
                    await asyncio.sleep(0.01)
            assert hub.subscribers == 1
            servers[1].draining = True
            async with asyncio.timeout(10):
                while not workers[1].draining:
                    await asyncio.sleep(0.01)
            assert view.healthy(workers[0]) and not view.healthy(workers[1])
            for s in servers:
                s.engine.start()
            stream = servers[0].engine.submit(list(range(40)), 4, ignore_eos=True)
            async for _ in stream:
                pass
            async with asyncio.timeout(10):
                while index.blocks_of(WorkerId("a")) == 0:
                    await asyncio.sleep(0.01)
            for s in servers:
                await s.stop()
                await s.engine.stop()
            async with asyncio.timeout(10):
                while any(w.feed_connected for w in workers):
                    await asyncio.sleep(0.01)
        finally:
            await client.stop()
            for s in servers:
                await s.stop()
