"""A virtual clock for unit tests (router, and any engine or transport test that takes a clock).

Emulated time advances only when every task is waiting on it, jumping to the next deadline: a scenario with
seconds of emulated waits runs in microseconds and always the same way. It offers what ``actors.clock.Clock``
offers the code under test (``now_ms``, ``sleep_until``, ``sleep_for``, ``time_scale``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualClock:
    time_scale = 1.0

    def __init__(self) -> None:
        self.t = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> float:
        return self.t

    def to_wall_s(self, emulated_ms: float) -> float:
        return emulated_ms / 1000.0

    def to_emulated_ms(self, wall_seconds: float) -> float:
        return wall_seconds * 1000.0

    async def sleep_until(self, deadline_ms: float) -> float:
        if deadline_ms <= self.t:
            await asyncio.sleep(0)
            return 0.0
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (deadline_ms, next(self._seq), fut))
        await fut
        return 0.0

    async def sleep_for(self, duration_ms: float) -> float:
        return await self.sleep_until(self.t + duration_ms)

    async def run(self, coro: Coroutine[Any, Any, T], *, limit_ms: float = 1e9) -> T:
        """Run ``coro`` to completion, jumping time forward whenever nothing else can run."""
        task = asyncio.get_running_loop().create_task(coro)
        while True:
            for _ in range(30):
                await asyncio.sleep(0)
            if task.done():
                return task.result()
            while self._timers and self._timers[0][2].done():
                heapq.heappop(self._timers)
            if not self._timers or self._timers[0][0] > limit_ms:
                task.cancel()
                raise AssertionError("deadlock: the scenario waits on nothing the clock can advance")
            t, _, fut = heapq.heappop(self._timers)
            self.t = max(self.t, t)
            fut.set_result(None)
