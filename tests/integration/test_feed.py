"""The engine's push feed on a real WebSocket: snapshot first, numbered KV batches, load beats that keep
coming while KV events stream without pause, resync on request, garbage refused."""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
from aiohttp import web

from actors.engine.kv_blocks import BlockHash, BlockStored
from actors.feed import FeedPublisher
from actors.http import serve_app
from tests.unit.engine.test_engine import engine


async def test_load_beats_continue_under_a_steady_stream_of_kv_events() -> None:
    eng = engine()
    beats = 0

    def load() -> dict[str, int]:
        return {"running": 0, "waiting": beats}

    pub = FeedPublisher(eng, load, interval_ms=40.0)
    app = web.Application()
    app.router.add_get("/feed", pub.handler)
    runner, port = await serve_app(app, "127.0.0.1", 0)
    frames: list[dict] = []
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{port}/feed") as ws:
            first = msgpack.unpackb((await ws.receive()).data, strict_map_key=False)
            assert first["t"] == "snapshot" and first["seq"] == 0

            async def events() -> None:  # a KV batch every 10 ms for 0.4 s: never a 40 ms lull
                for seq in range(1, 41):
                    pub._on_kv(seq, [BlockStored((BlockHash(seq),), None, 16)])
                    await asyncio.sleep(0.01)

            producer = asyncio.create_task(events())
            async with asyncio.timeout(10):
                while not frames or frames[-1].get("seq") != 40:
                    frames.append(msgpack.unpackb((await ws.receive()).data, strict_map_key=False))
            await producer
            await ws.send_bytes(msgpack.packb({"t": "resync"}))
            async with asyncio.timeout(10):
                while frames[-1]["t"] != "snapshot":
                    frames.append(msgpack.unpackb((await ws.receive()).data, strict_map_key=False))
            await ws.send_bytes(b"\xc1 not msgpack")
            closing = await asyncio.wait_for(ws.receive(), 2.0)
            assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) and ws.close_code == 1003
    finally:
        await runner.cleanup()
    kv = [f["seq"] for f in frames if f["t"] == "kv"]
    assert kv == list(range(1, 41))
    assert sum(f["t"] == "load" for f in frames) >= 5  # 0.4 s at one beat per 40 ms, with slack
