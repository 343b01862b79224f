"""Unit-test helpers for the transport: a virtual clock that jumps to the next deadline when idle."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from actors.clock import Clock

T = TypeVar("T")


class VirtualClock:
    """Emulated time that advances only when every task is waiting on it (deterministic, instant)."""

    time_scale = 1.0

    def __init__(self) -> None:
        self.t = 0.0
        self._timers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now_ms(self) -> float:
        return self.t

    def to_wall_s(self, emulated_ms: float) -> float:
        return emulated_ms / 1000.0 + 3600.0  # deadlines never fire in virtual tests

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

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to completion, jumping time forward whenever nothing else can run."""
        task = asyncio.get_running_loop().create_task(coro)
        while True:
            for _ in range(30):
                await asyncio.sleep(0)
            if task.done():
                return task.result()
            while self._timers and self._timers[0][2].done():
                heapq.heappop(self._timers)
            if not self._timers:
                task.cancel()
                raise AssertionError("deadlock: the scenario waits on nothing the clock can advance")
            t, _, fut = heapq.heappop(self._timers)
            self.t = max(self.t, t)
            fut.set_result(None)


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def clock() -> Clock:
    return Clock(1.0)


@pytest.fixture(autouse=True)
async def no_tasks_left_behind() -> Any:
    """Every test leaves no task running on its loop."""
    yield
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"
