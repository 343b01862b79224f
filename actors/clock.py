"""The emulated clock: emulated milliseconds, time scaling, sleeps to absolute deadlines, step lag.

``time_scale`` is wall seconds per emulated second (1.0 = real time, 0.2 = five times faster). Every
emulated wait sleeps to an absolute deadline, so one sleep's overshoot is never carried into the next.
Event-loop timers (uvloop's in particular) fire up to about a millisecond late, so the clock sleeps to
``spin_ms`` before the deadline and then yields to the loop until the deadline has passed: a few
hundred microseconds of polling per wait buys sub-millisecond lag. ``spin_ms=0`` turns polling off.

With polling on, every waiter of one clock (all the engines of a process) shares ONE timer: waiters sit
in a heap of (deadline, order, future); a single loop callback is armed ``spin_ms`` before the earliest
deadline, then re-queues itself once per loop iteration (``call_soon``) until that deadline passes and
resolves every waiter that is due, in deadline order. So 64 engines stepping together cost one poll per
loop iteration, not 64, and an idle engine (no waiter) costs nothing. A cancelled waiter is skipped when
popped. The heap belongs to the running loop: a clock used from a new loop (tests) starts a fresh one.

Two ways to cover the last ``spin_ms`` (``waker``): ``spin`` re-queues the callback every loop turn (the
process is busy for that millisecond before every deadline: on a small host that CPU is taken from the
router and the load generator); ``thread`` (the default with the real monotonic clock) has one helper
thread per clock sleep precisely off the loop (``Condition.wait``, ~0.1 ms slack) until the earliest
deadline and then wake the loop (``call_soon_threadsafe``): no polling at all, one wake-up per deadline.
The thread holds no lock while it sleeps and needs the GIL only to post the wake-up; it exits after
``IDLE_THREAD_S`` without a deadline and is started again by the next one. ``timerfd`` (Linux) arms a
timerfd at the earliest deadline and has the loop wake on it (``actors.timerfd``): one wake-up of the loop's
own thread per deadline, no helper thread, no polling.

Lag is how late a deadline really ended, in wall milliseconds; ``lag_emulated_ms`` divides by the scale
(a 1 ms wall lag at scale 0.1 is 10 emulated ms).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Literal

import numpy as np

from actors import timerfd

DEFAULT_SPIN_MS = 1.0
IDLE_THREAD_S = 5.0
Waker = Literal["thread", "spin", "timerfd"]


class _ThreadWaker:
    """Sleeps off the loop to a wall deadline (``time.monotonic``), then calls ``fire`` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[], None]) -> None:
        self.loop = loop
        self.fire = fire
        self._cond = threading.Condition()
        self._due: float | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def set(self, due: float) -> None:
        with self._cond:
            self._due = due
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvmesh-clock", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _run(self) -> None:
        cond, mono = self._cond, time.monotonic
        while True:
            with cond:
                idle_since = mono()
                while not self._stop:
                    if self._due is None:
                        if mono() - idle_since > IDLE_THREAD_S:
                            self._thread = None
                            return
                        cond.wait(IDLE_THREAD_S)
                        continue
                    left = self._due - mono()
                    if left <= 0:
                        break
                    cond.wait(left)
                if self._stop:
                    self._thread = None
                    return
                self._due = None
            try:
                self.loop.call_soon_threadsafe(self.fire)
            except RuntimeError:  # the loop is closed
                with cond:
                    self._thread = None
                return


class Clock:
    """Emulated time for one process. ``now_ms()`` starts at 0 when the clock is made (or at ``origin``)."""

    def __init__(self, time_scale: float = 1.0, *, spin_ms: float = DEFAULT_SPIN_MS,
                 monotonic: Callable[[], float] = time.monotonic, origin: float | None = None,
                 waker: Waker | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if waker in ("thread", "timerfd") and monotonic is not time.monotonic:
            raise ValueError(f"the {waker} waker sleeps in real time: it needs the real monotonic clock")
        if waker == "timerfd" and not timerfd.available():
            raise ValueError("the timerfd waker needs Linux's timerfd: use the thread or spin waker here")
        self.waker: Waker = waker or ("thread" if monotonic is time.monotonic else "spin")
        self._thread_waker: _ThreadWaker | timerfd.TimerFdWaker | None = None
        """What wakes the loop at the earliest deadline (``thread``, ``timerfd``); None: the loop's timers."""
        self.time_scale = time_scale
        self.spin_s = max(0.0, spin_ms) / 1000.0
        self._monotonic = monotonic
        self.origin = monotonic() if origin is None else origin
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed: asyncio.Handle | None = None
        self._armed_for = float("inf")
        """The deadline (wall) the armed wake-up serves (inf: none); re-armed when an earlier waiter arrives."""
        self.polls = 0
        """How many times the shared timer woke (a measure of the polling cost)."""

    # -- conversions -------------------------------------------------------------------------------
    def now_ms(self) -> float:
        """Emulated milliseconds since the origin."""
        return (self._monotonic() - self.origin) / self.time_scale * 1000.0

    def wall_of(self, emulated_ms: float) -> float:
        """The monotonic wall time at which emulated time ``emulated_ms`` happens."""
        return self.origin + emulated_ms / 1000.0 * self.time_scale

    def to_emulated_ms(self, wall_seconds: float) -> float:
        """A wall duration (seconds) as emulated milliseconds."""
        return wall_seconds / self.time_scale * 1000.0

    def to_wall_s(self, emulated_ms: float) -> float:
        """An emulated duration (ms) as wall seconds."""
        return emulated_ms / 1000.0 * self.time_scale

    # -- waiting -----------------------------------------------------------------------------------
    async def sleep_until(self, deadline_ms: float) -> float:
        """Sleep until emulated time ``deadline_ms``; return the lag in wall ms (how late it really ended)."""
        target = self.wall_of(deadline_ms)
        mono = self._monotonic
        if self.spin_s <= 0:
            remaining = target - mono()
            if remaining > 0:
                await asyncio.sleep(remaining)
            return max(0.0, (mono() - target) * 1000.0)
        if target <= mono():
            return (mono() - target) * 1000.0
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._thread_waker is not None:
                self._thread_waker.stop()
            self._loop, self._heap, self._armed, self._armed_for = loop, [], None, float("inf")
            self._thread_waker = (_ThreadWaker(loop, self._fire) if self.waker == "thread"
                                  else timerfd.TimerFdWaker(loop, self._fire) if self.waker == "timerfd" else None)
        fut: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._heap, (target, next(self._order), fut))
        if target < self._armed_for:
            self._arm(loop)
        await fut
        return max(0.0, (mono() - target) * 1000.0)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """(Re)schedule the one wake-up for the earliest waiter (``_armed_for``; inf: none armed)."""
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)  # cancelled waiters (a stopped engine)
        if not self._heap:
            self._armed_for = float("inf")
            return
        self._armed_for = self._heap[0][0]
        if self._thread_waker is not None:
            self._thread_waker.set(self._armed_for)
            return
        remaining = self._armed_for - self._monotonic() - self.spin_s
        self._armed = loop.call_later(remaining, self._fire) if remaining > 0 else loop.call_soon(self._fire)

    def _fire(self) -> None:
        self._armed = None
        self._armed_for = float("inf")
        self.polls += 1
        now = self._monotonic()
        heap = self._heap
        while heap and heap[0][0] <= now:
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)
        if heap and self._loop is not None:
            self._arm(self._loop)

    async def sleep_for(self, duration_ms: float) -> float:
        """Sleep ``duration_ms`` emulated ms from now (to an absolute deadline); return the wall lag in ms."""
        return await self.sleep_until(self.now_ms() + duration_ms)

    def lag_emulated_ms(self, wall_lag_ms: float) -> float:
        return wall_lag_ms / self.time_scale


class LagRecorder:
    """Keeps the last ``capacity`` step lags (wall ms) in a ring and answers percentiles.

    The ring is a numpy array and a percentile is a selection (``np.partition``, one pass for p50 and p99
    together) rather than a sort of the whole ring per call: the feed asks every busy engine for its lag
    p50 and p99 at each load report (every 50 ms), and two sorts of 4096 floats per engine held the loop for
    about a millisecond each time (10% of an engine process's CPU in a profile of the Mooncake slice).
    A percentile is the sorted sample at index ``round(q / 100 * (n - 1))``.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._buf = np.zeros(capacity)
        self._n = 0
        """How many slots hold a lag (the ring fills from slot 0, so they are ``_buf[:_n]``)."""
        self._i = 0
        self.count = 0
        self.max_ms = 0.0

    def add(self, lag_ms: float) -> None:
        self.count += 1
        if lag_ms > self.max_ms:
            self.max_ms = lag_ms
        self._buf[self._i] = lag_ms
        self._i = (self._i + 1) % self.capacity
        if self._n < self.capacity:
            self._n += 1

    def percentiles(self, *qs: float) -> list[float]:
        n = self._n
        if not n:
            return [0.0 for _ in qs]
        ks = [min(n - 1, max(0, round(q / 100.0 * (n - 1)))) for q in qs]
        part = np.partition(self._buf[:n], sorted(set(ks)))
        return [float(part[k]) for k in ks]

    def percentile(self, q: float) -> float:
        return self.percentiles(q)[0]

    def samples(self) -> list[float]:
        """The lags the ring holds (its last ``capacity``), oldest order not kept: for pooling across engines."""
        return [float(x) for x in self._buf[:self._n]]

    def reset(self) -> None:
        self._n = 0
        self._i = 0
        self.count = 0
        self.max_ms = 0.0

    def summary(self) -> dict[str, float]:
        p50, p99 = self.percentiles(50, 99)
        return {"p50": p50, "p99": p99, "max": self.max_ms, "count": float(self.count)}
