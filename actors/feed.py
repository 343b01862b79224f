"""The engine's push feed to routers: KV events and load over one persistent WebSocket, msgpack frames.

Frames (msgpack maps, key ``t`` gives the type):
- ``snapshot``: ``seq`` (last KV event batch number), ``bs`` (block size), ``hashes`` (every block hash
  the engine's prefix cache holds), ``load``. Sent on connect and whenever the router asks
  ``{"t": "resync"}`` (after it saw a gap in ``seq``).
- ``kv``: ``seq`` and ``events``: ``["stored", [hash, ...], parent | None]``, ``["removed", [hash, ...]]``,
  ``["cleared"]``. Batches are numbered 1, 2, 3 ... without gaps.
- ``load``: running, waiting, KV usage, free blocks, step-lag p99, in-flight requests, draining; sent
  every ``interval_ms`` wall milliseconds whether or not KV events flow meanwhile; it doubles as the
  heartbeat.

A slow router never slows the engine: each subscriber has a bounded queue; when it overflows the batch is
dropped for that subscriber only, who then sees a gap and resyncs from a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgpack
from aiohttp import WSMsgType, web

from actors.engine.engine import Engine
from actors.engine.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

QUEUE_LIMIT = 4096


def encode_events(events: list[KVEvent]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(["stored", list(ev.block_hashes), ev.parent_block_hash])
        elif isinstance(ev, BlockRemoved):
            out.append(["removed", list(ev.block_hashes)])
        elif isinstance(ev, AllBlocksCleared):
            out.append(["cleared"])
    return out


class FeedPublisher:
    def __init__(self, engine: Engine, load: Callable[[], dict[str, Any]], interval_ms: float = 50.0) -> None:
        self.engine = engine
        self.load = load
        self.interval_s = interval_ms / 1000.0
        self._subs: set[asyncio.Queue[tuple[int, list[list[Any]]]]] = set()
        engine.kv_subscribers.append(self._on_kv)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def _on_kv(self, seq: int, events: list[KVEvent]) -> None:
        if not self._subs:
            return
        batch = (seq, encode_events(events))
        for q in self._subs:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(batch)

    def snapshot(self) -> dict[str, Any]:
        return {"t": "snapshot", "seq": self.engine.kv_event_seq, "bs": self.engine.cfg.block_size,
                "hashes": list(self.engine.kv.pool.cached.keys()), "load": self.load()}

    async def handler(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=1 << 20)
        await ws.prepare(request)
        q: asyncio.Queue[tuple[int, list[list[Any]]]] = asyncio.Queue(QUEUE_LIMIT)
        self._subs.add(q)
        resync = asyncio.Event()
        reader = asyncio.get_running_loop().create_task(self._read(ws, resync))
        pack = msgpack.packb
        clock = asyncio.get_running_loop().time
        getter: asyncio.Future[tuple[int, list[list[Any]]]] | None = None
        try:
            await ws.send_bytes(pack(self.snapshot()))
            last_load = clock()
            while not ws.closed:
                if resync.is_set():
                    resync.clear()
                    while not q.empty():
                        q.get_nowait()
                    await ws.send_bytes(pack(self.snapshot()))
                    last_load = clock()
                # One get outlives the waits: a get cancelled by a timeout can lose the batch it took.
                if getter is None:
                    getter = asyncio.ensure_future(q.get())
                await asyncio.wait((getter,), timeout=max(0.0, last_load + self.interval_s - clock()))
                if getter.done():
                    seq, events = getter.result()
                    getter = None
                    await ws.send_bytes(pack({"t": "kv", "seq": seq, "events": events}))
                # Load beats every interval even while KV events stream without pause.
                if clock() - last_load >= self.interval_s:
                    await ws.send_bytes(pack({"t": "load", **self.load()}))
                    last_load = clock()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._subs.discard(q)
            if getter is not None:
                getter.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await ws.close()
        return ws

    async def _read(self, ws: web.WebSocketResponse, resync: asyncio.Event) -> None:
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                continue
            try:
                obj = msgpack.unpackb(msg.data)
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                await ws.close(code=1003, message=b"frames must be msgpack")
                return
            if isinstance(obj, dict) and obj.get("t") == "resync":
                resync.set()
