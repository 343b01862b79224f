"""Request deadlines: one sweeper for every request rather than a timer each.

``track(task, deadline_ms)`` registers a request's task with its deadline on the router's clock (emulated
ms, so a slowed-down cluster keeps its deadlines); the sweeper wakes every ``period_ms`` and cancels each
task past its deadline, remembering it in ``expired`` so the request's handler can tell its own deadline
from any other cancellation (a client disconnect) and answer 504. Per-request timers cost the hot path
more than this sweep does; a deadline fires at most one period late. ``end_all`` (a graceful stop of the
router) cancels every tracked request at once, remembered in ``ended`` so each handler answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from cluster.router.attempt import RouterClock


class DeadlineSweeper:
    def __init__(self, clock: RouterClock, timeout_ms: float) -> None:
        self.clock = clock
        self.timeout_ms = timeout_ms
        self.period_ms = min(250.0 / clock.time_scale, max(2.0 / clock.time_scale, timeout_ms / 100.0))
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._ended: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweep(), name="router-deadlines")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def track(self, task: asyncio.Task[Any]) -> None:
        self._deadlines[task] = self.clock.now_ms() + self.timeout_ms

    def expired(self, task: asyncio.Task[Any]) -> bool:
        return task in self._expired

    def ended(self, task: asyncio.Task[Any]) -> bool:
        return task in self._ended

    def forget(self, task: asyncio.Task[Any]) -> None:
        self._deadlines.pop(task, None)
        self._expired.discard(task)
        self._ended.discard(task)

    def end_all(self) -> list[asyncio.Task[Any]]:
        """Cancel every tracked request not already past its deadline (a graceful stop); those cancelled."""
        ended = [t for t in self._deadlines if t not in self._expired and t not in self._ended and not t.done()]
        for task in ended:
            self._ended.add(task)
            task.cancel()
        return ended

    @property
    def tracked(self) -> int:
        return len(self._deadlines)

    async def _sweep(self) -> None:
        while True:
            await self.clock.sleep_for(self.period_ms)
            now = self.clock.now_ms()
            for task, deadline in list(self._deadlines.items()):
                if deadline <= now and task not in self._expired:
                    self._expired.add(task)
                    task.cancel()
