"""The router's end of the engines' push feeds: one persistent WebSocket per engine process, msgpack frames.

Workers launched together in one actor share a ``feed_url`` (``actors.feed.FeedHub``): one ``FeedClient``
carries all of them, subscribing by name (``sub``/``unsub`` as workers join and leave). A worker without
one (an engine started on its own) gets a client of its own at its URL.

Frames update the workers' load and the prefix index (see ``actors.feed`` for the frame types). A gap in a
worker's KV batch numbers (a batch lost to an overflowing queue) triggers ``{"t": "resync", "e": name}``
and the engine answers with a snapshot. Liveness: any frame (a ``beat`` included) refreshes ``last_seen``
of every worker on the connection; ``ClusterView.healthy`` turns a worker unhealthy when that is older
than ``health_timeout_s`` (a hung process), and a dropped connection marks every worker on it down at
once (a dead process). Reconnects use capped exponential backoff and resubscribe everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp
import msgpack

from cluster.router.prefix_index import PrefixIndex
from cluster.router.view import WorkerId, WorkerInfo


class FeedClient:
    def __init__(self, url: str, index: PrefixIndex, session: aiohttp.ClientSession,
                 now: Callable[[], float], on_frame: Callable[[WorkerInfo, dict[str, Any]], None] | None = None,
                 ) -> None:
        self.url = url
        self.workers: dict[WorkerId, WorkerInfo] = {}
        self.index = index
        self.session = session
        self.now = now
        self.on_frame = on_frame
        self.frames = 0
        self.resyncs = 0
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"feed-{self.url}")

    async def add(self, w: WorkerInfo) -> None:
        self.workers[w.name] = w
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                await self._ws.send_bytes(msgpack.packb({"t": "sub", "e": [w.name]}))

    async def remove(self, name: WorkerId) -> None:
        w = self.workers.pop(name, None)
        if w is not None:
            w.feed_connected = False
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                await self._ws.send_bytes(msgpack.packb({"t": "unsub", "e": [name]}))

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._down()

    def _down(self) -> None:
        for w in self.workers.values():
            w.feed_connected = False

    async def _run(self) -> None:
        backoff = 0.1
        url = self.url + "/kvmesh/feed?engines="
        while not self._stopping:
            try:
                async with self.session.ws_connect(url, heartbeat=5.0, max_msg_size=64 << 20) as ws:
                    self._ws = ws
                    backoff = 0.1
                    await ws.send_bytes(msgpack.packb({"t": "sub", "e": list(self.workers)}))
                    async for msg in ws:
                        if msg.type != aiohttp.WSMsgType.BINARY:
                            continue
                        for name in self._handle(msgpack.unpackb(msg.data, strict_map_key=False)):
                            await ws.send_bytes(msgpack.packb({"t": "resync", "e": name}))
                            self.resyncs += 1
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                pass
            self._ws = None
            self._down()
            if self._stopping:
                return
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _handle(self, frame: Any) -> list[str]:
        """Apply one message; the workers whose index needs a resync from a snapshot."""
        if not isinstance(frame, dict):
            return []
        self.frames += 1
        now = self.now()
        for w in self.workers.values():  # any frame proves the process (every engine on it) is alive
            w.last_seen = now
        kind = frame.get("t")
        if kind == "batch":
            out: list[str] = []
            for f in frame.get("f", ()):
                out.extend(self._one(f, now))
            return out
        return self._one(frame, now)

    def _one(self, frame: Any, now: float) -> list[str]:
        if not isinstance(frame, dict):
            return []
        kind = frame.get("t")
        if kind == "load":
            for name, load in frame.get("loads", {}).items():
                w = self.workers.get(name)
                if w is not None and isinstance(load, dict):
                    w.feed_connected = True
                    w.update_load(load, now)
                    self._tell(w, {"t": "load", **load})
            return []
        if kind == "beat":
            return []
        w = self.workers.get(frame.get("e", ""))
        if w is None:
            return []
        ok = True
        if kind == "snapshot":
            w.feed_connected = True
            w.block_size = int(frame.get("bs", w.block_size))
            self.index.apply_snapshot(w.name, int(frame["seq"]), frame.get("hashes", ()))
            w.update_load(frame.get("load", {}), now)
        elif kind == "kv":
            w.feed_connected = True
            ok = self.index.apply(w.name, int(frame["seq"]), frame.get("events", ()))
        elif kind == "gone":
            w.feed_connected = False
        self._tell(w, frame)
        return [] if ok else [w.name]

    def _tell(self, w: WorkerInfo, frame: dict[str, Any]) -> None:
        if self.on_frame is not None:
            self.on_frame(w, frame)
