"""The router's end of each engine's push feed: one persistent WebSocket per worker, msgpack frames.

Frames update the worker's load and the prefix index (see ``actors.feed`` for the frame types). A gap in
KV batch numbers (a batch lost to an overflowing queue) triggers ``{"t": "resync"}`` and the engine
answers with a snapshot. A dropped connection marks the worker's feed down (so it is unhealthy) and is
retried with capped exponential backoff; any frame marks it up again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp
import msgpack

from cluster.router.prefix_index import PrefixIndex
from cluster.router.view import WorkerInfo


class FeedClient:
    def __init__(self, worker: WorkerInfo, index: PrefixIndex, session: aiohttp.ClientSession,
                 now: Callable[[], float], on_frame: Callable[[WorkerInfo, dict[str, Any]], None] | None = None,
                 ) -> None:
        self.worker = worker
        self.index = index
        self.session = session
        self.now = now
        self.on_frame = on_frame
        self.frames = 0
        self.resyncs = 0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"feed-{self.worker.name}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.worker.feed_connected = False

    async def _run(self) -> None:
        backoff = 0.1
        url = self.worker.url + "/kvmesh/feed"
        while not self._stopping:
            try:
                async with self.session.ws_connect(url, heartbeat=5.0, max_msg_size=64 << 20) as ws:
                    backoff = 0.1
                    async for msg in ws:
                        if msg.type != aiohttp.WSMsgType.BINARY:
                            continue
                        if not self._handle(msgpack.unpackb(msg.data, strict_map_key=False)):
                            await ws.send_bytes(msgpack.packb({"t": "resync"}))
                            self.resyncs += 1
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                pass
            self.worker.feed_connected = False
            if self._stopping:
                return
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _handle(self, frame: Any) -> bool:
        """Apply one frame; False when the index needs a resync from a snapshot."""
        if not isinstance(frame, dict):
            return True
        w = self.worker
        self.frames += 1
        w.feed_connected = True
        w.last_seen = self.now()
        kind = frame.get("t")
        ok = True
        if kind == "snapshot":
            w.block_size = int(frame.get("bs", w.block_size))
            self.index.apply_snapshot(w.name, int(frame["seq"]), frame.get("hashes", ()))
            w.update_load(frame.get("load", {}), self.now())
        elif kind == "kv":
            ok = self.index.apply(w.name, int(frame["seq"]), frame.get("events", ()))
        elif kind == "load":
            w.update_load(frame, self.now())
        if self.on_frame is not None:
            self.on_frame(w, frame)
        return ok
