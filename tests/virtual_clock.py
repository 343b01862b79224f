"""A virtual clock for unit tests (router, and any engine or transport test that takes a clock).

It is the product's jumping clock (``actors.jump_clock.JumpClock``: emulated time advances only when every
task is waiting on it, jumping to the next deadline), made strict for tests: a scenario that waits on
nothing the clock can advance fails at once as a deadlock, and emulated deadlines map to wall time as they
are (``Clock`` at time scale 1).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from actors.jump_clock import JumpClock

T = TypeVar("T")


class VirtualClock(JumpClock):
    wait_on_io = False
    wall_offset_s = 0.0

    async def run(self, coro: Coroutine[Any, Any, T], *, limit_ms: float = 1e9) -> T:
        return await super().run(coro, limit_ms=limit_ms)
