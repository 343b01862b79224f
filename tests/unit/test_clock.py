"""The emulated clock: conversions, absolute deadlines, lag."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.clock import Clock, LagRecorder, Waker, _ThreadWaker
from actors.timerfd import TimerFdWaker, available

NEEDS_TIMERFD = pytest.mark.skipif(not available(), reason="timerfd is Linux only")
TIMERFD = pytest.param("timerfd", marks=NEEDS_TIMERFD)


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_conversions_follow_the_time_scale() -> None:
    ft = FakeTime()
    c = Clock(0.2, monotonic=ft)
    assert c.now_ms() == 0.0
    ft.t += 1.0  # one wall second at scale 0.2 is five emulated seconds
    assert c.now_ms() == pytest.approx(5000.0)
    assert c.wall_of(5000.0) == pytest.approx(101.0)
    assert c.to_wall_s(1000.0) == pytest.approx(0.2)
    assert c.to_emulated_ms(0.2) == pytest.approx(1000.0)
    assert c.lag_emulated_ms(1.0) == pytest.approx(5.0)


def test_bad_scale_is_rejected() -> None:
    with pytest.raises(ValueError):
        Clock(0)


@pytest.mark.parametrize("scale", [1.0, 0.1])
@pytest.mark.parametrize(("spin", "waker"), [(1.0, "thread"), (1.0, "spin"),
                                            pytest.param(1.0, "timerfd", marks=NEEDS_TIMERFD), (0.0, None)])
async def test_sleep_until_never_wakes_before_the_deadline(scale: float, spin: float, waker: Waker | None) -> None:
    c = Clock(scale, spin_ms=spin, waker=waker)
    deadline = 0.0
    for d in (3.0, 1.0, 7.0, 0.5, 2.0):
        deadline += d
        lag = await c.sleep_until(deadline)
        assert time.monotonic() >= c.wall_of(deadline)
        assert lag >= 0.0


async def test_deadlines_in_the_past_return_at_once_with_their_lag() -> None:
    c = Clock(1.0)
    await asyncio.sleep(0.01)
    lag = await c.sleep_until(0.0)
    assert lag >= 10.0


async def test_overshoot_does_not_accumulate_over_absolute_deadlines() -> None:
    c = Clock(1.0, spin_ms=0.0)
    for i in range(1, 21):
        await c.sleep_until(i * 2.0)
    # 20 sleeps of 2 ms to absolute deadlines end near 40 ms, however late each single one woke.
    assert c.now_ms() < 40.0 + 25.0


def test_lag_recorder_percentiles_and_bound() -> None:
    r = LagRecorder(capacity=100)
    for i in range(1000):
        r.add(float(i % 100))
    assert r.count == 1000 and r.max_ms == 99.0
    assert r.percentile(50) == pytest.approx(50.0, abs=1)
    assert len(r._buf) == 100


@settings(max_examples=100, deadline=None)
@given(lags=st.lists(st.floats(0, 1e4), max_size=60), capacity=st.integers(1, 20))
def test_lag_recorder_percentiles_are_the_sorted_recent_window(lags: list[float], capacity: int) -> None:
    r = LagRecorder(capacity)
    for x in lags:
        r.add(x)
    window = sorted(lags[-capacity:])
    for q in (0, 50, 99, 100):
        want = window[min(len(window) - 1, max(0, round(q / 100 * (len(window) - 1))))] if window else 0.0
        assert r.percentile(q) == want
    assert r.summary()["p99"] == r.percentile(99) and r.count == len(lags)
    r.reset()
    assert r.percentile(99) == 0.0 and r.count == 0


@pytest.mark.parametrize("waker", ["thread", "spin", TIMERFD])
async def test_concurrent_waiters_share_one_timer_and_wake_in_deadline_order(waker: Waker) -> None:
    c = Clock(1.0, spin_ms=1.0, waker=waker)
    woke: list[int] = []

    async def waiter(i: int, deadline: float) -> None:
        await c.sleep_until(deadline)
        assert time.monotonic() >= c.wall_of(deadline)
        woke.append(i)

    base = c.now_ms() + 100.0  # far enough ahead that every waiter really waits, even on a busy host
    deadlines = [base + (i * 7) % 13 for i in range(32)]
    await asyncio.gather(*(waiter(i, d) for i, d in enumerate(deadlines)))
    assert [deadlines[i] for i in woke] == sorted(deadlines)
    assert c._armed is None and not c._heap  # nothing left armed or waiting


@pytest.mark.parametrize("waker", ["thread", "spin", TIMERFD])
async def test_a_cancelled_waiter_does_not_stop_the_others(waker: Waker) -> None:
    c = Clock(1.0, spin_ms=1.0, waker=waker)
    base = c.now_ms() + 100.0
    early = asyncio.ensure_future(c.sleep_until(base))
    late = asyncio.ensure_future(c.sleep_until(base + 4.0))
    await asyncio.sleep(0)
    early.cancel()
    lag = await late
    await asyncio.gather(early, return_exceptions=True)
    assert lag >= 0.0 and early.cancelled()
    assert time.monotonic() >= c.wall_of(base + 4.0)


@pytest.mark.parametrize("waker", ["thread", "spin", TIMERFD])
async def test_an_earlier_waiter_rearms_the_shared_timer(waker: Waker) -> None:
    c = Clock(1.0, spin_ms=1.0, waker=waker)
    base = c.now_ms()
    late = asyncio.ensure_future(c.sleep_until(base + 2000.0))
    await asyncio.sleep(0)
    assert c._armed_for == c.wall_of(base + 2000.0)
    early = asyncio.ensure_future(c.sleep_until(base + 100.0))
    await asyncio.sleep(0)
    assert c._armed_for == c.wall_of(base + 100.0)  # the one timer now serves the earlier deadline
    await early
    assert not late.done() and c._armed_for == c.wall_of(base + 2000.0)
    late.cancel()


def test_the_thread_waker_needs_the_real_clock() -> None:
    wakers: tuple[Waker, ...] = ("thread", "timerfd")
    for waker in wakers:
        with pytest.raises(ValueError):
            Clock(1.0, monotonic=FakeTime(), waker=waker)
    assert Clock(1.0, monotonic=FakeTime()).waker == "spin" and Clock(1.0).waker == "thread"


async def test_the_thread_waker_serves_a_new_loop_after_the_old_one() -> None:
    c = Clock(1.0)
    await c.sleep_until(2.0)
    first = c._thread_waker

    def other_loop() -> float:
        return asyncio.run(c.sleep_until(c.now_ms() + 2.0))

    assert await asyncio.get_running_loop().run_in_executor(None, other_loop) >= 0.0
    assert c._thread_waker is not first and isinstance(first, _ThreadWaker) and first._stop


@NEEDS_TIMERFD
async def test_the_timerfd_waker_serves_a_new_loop_and_closes_the_old_descriptor() -> None:
    c = Clock(1.0, waker="timerfd")
    await c.sleep_until(c.now_ms() + 2.0)
    first = c._thread_waker
    assert isinstance(first, TimerFdWaker) and first.fd is not None

    def other_loop() -> float:
        return asyncio.run(c.sleep_until(c.now_ms() + 2.0))

    assert await asyncio.get_running_loop().run_in_executor(None, other_loop) >= 0.0
    assert c._thread_waker is not first and first.fd is None  # unregistered and closed
