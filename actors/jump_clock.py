"""Jumping virtual time: emulated time that moves only when every task waits on it.

``JumpClock`` offers what engines, tiers, the transport and the router ask of a clock (``now_ms``,
``sleep_until``, ``sleep_for``, ``time_scale``, ``to_wall_s``). ``run(coro)`` gives ready work
``settle_turns`` event-loop turns, then jumps to the earliest pending deadline and wakes its sleeper, so
seconds of emulated waits pass in microseconds and always the same way.

When nothing waits on the clock, the run either lets real I/O (a thread, a socket) finish and looks again
(``wait_on_io``, for whole virtual clusters with disk tiers), or fails at once as a deadlock (unit tests,
where nothing real should be running). ``to_wall_s`` maps emulated deadlines ``wall_offset_s`` into wall
time, so wall-clock timeouts derived from them (the transport's) never fire on virtual time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class JumpClock:
    """Emulated time advanced only by ``run``, to the earliest deadline whenever every task waits (see above)."""

    time_scale = 1.0
    settle_turns = 30
    """Event-loop turns given to ready work before time jumps (enough for a put or a load's real I/O)."""
    wait_on_io = True
    """With no sleeper pending: wait for real I/O (True) or fail as a deadlock (False)."""
    wall_offset_s = 3600.0

    def __init__(self) -> None:
        self.t = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.jumps = 0

    def now_ms(self) -> float:
        return self.t

    def to_wall_s(self, emulated_ms: float) -> float:
        return emulated_ms / 1000.0 + self.wall_offset_s

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

    async def run(self, coro: Coroutine[Any, Any, T], *, limit_ms: float = float("inf")) -> T:
        """Run ``coro`` to completion, jumping time forward whenever nothing else can run; past ``limit_ms``
        of emulated time it is cancelled and ``TimeoutError`` raised (a run that can never finish)."""
        task = asyncio.get_running_loop().create_task(coro)
        while True:
            for _ in range(self.settle_turns):
                await asyncio.sleep(0)
            if task.done():
                return task.result()
            while self._timers and self._timers[0][2].done():
                heapq.heappop(self._timers)
            if not self._timers:
                if not self.wait_on_io:
                    task.cancel()
                    raise AssertionError("deadlock: the scenario waits on nothing the clock can advance")
                await asyncio.sleep(0.001)  # real I/O still running (a thread, a socket): let it finish
                continue
            if self._timers[0][0] > limit_ms:
                task.cancel()
                raise TimeoutError(f"virtual run still going at its limit of {limit_ms:.0f} emulated ms")
            t, _, fut = heapq.heappop(self._timers)
            self.t = max(self.t, t)
            self.jumps += 1
            fut.set_result(None)
