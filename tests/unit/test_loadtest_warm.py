"""The open loop's bursts and the warm keep-alive pool's size (cluster/loadtest/replay.py, warm.py): virtual
clock, a stand-in client, no sockets."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from actors.clock import Clock
from cluster.loadtest import RequestId, RequestSpec
from cluster.loadtest.client import PreparedRequest
from cluster.loadtest.prebuild import Prebuilder
from cluster.loadtest.record import RequestRecord
from cluster.loadtest.replay import ReplayConfig, _open_loop
from cluster.loadtest.warm import warm_count


def test_warm_count_is_the_most_deadlines_within_any_window() -> None:
    bursts = [0.0] * 10 + [3.0] * 16 + [6.0] * 3 + [9.0] * 9
    assert warm_count(bursts, window_s=1.0) == 16
    assert warm_count(bursts, window_s=3.0) == 26  # both ends of the window count
    assert warm_count(bursts, window_s=2.999) == 16
    assert warm_count(list(reversed(bursts)), window_s=6.0) == 29  # any order
    assert warm_count(bursts, window_s=100.0, cap=20) == 20
    assert warm_count([], window_s=5.0) == 0
    assert warm_count([1.0, 2.5, 4.0], window_s=0.0) == 1


def test_warm_count_and_replay_config_refuse_negative_sizes() -> None:
    with pytest.raises(ValueError, match="window_s"):
        warm_count([0.0], window_s=-1.0)
    with pytest.raises(ValueError, match="cap"):
        warm_count([0.0], cap=-1)
    with pytest.raises(ValueError, match="warm_connections"):
        ReplayConfig(warm_connections=-1)
    assert ReplayConfig().warm_connections is None and ReplayConfig(warm_connections=0).warm_connections == 0


class Turns:
    """A virtual monotonic clock that moves 1 ms per event-loop pass, and counts the passes."""

    def __init__(self) -> None:
        self.now = 100.0
        self.turns = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self) -> float:
        return self.now

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.turns += 1
        self.now += 0.001
        assert self._loop is not None
        self._loop.call_soon(self._tick)


class StandInClient:
    """What the open loop calls on its client: ``send``, logged with the loop pass it started in."""

    def __init__(self, turns: Turns, log: list[tuple[str, str, int]]) -> None:
        self.turns = turns
        self.log = log

    async def send(self, prepared: PreparedRequest, scheduled_wall: float) -> RequestRecord:
        self.log.append(("send", prepared.spec.request_id, self.turns.turns))
        await asyncio.sleep(0)
        return RequestRecord(request_id=prepared.spec.request_id, status="ok", scheduled_ms=0.0, sent_ms=0.0,
                             input_len=1, expected_output_len=1)


async def test_a_burst_is_started_in_one_loop_pass_before_later_bodies_are_built() -> None:
    turns, log = Turns(), list[tuple[str, str, int]]()
    turns.start()
    arrivals = [0.0, 0.0, 0.0, 100.0, 100.0, 200.0]
    specs = [RequestSpec(RequestId(f"r{i}"), a, 1, 1) for i, a in enumerate(arrivals)]

    def prepare(spec: RequestSpec) -> PreparedRequest:
        log.append(("build", spec.request_id, turns.turns))
        return PreparedRequest(spec, b"x", {})

    # A 1-byte budget holds one body: the rest of each burst is built when taken, the next burst's first
    # body between the bursts. spin_ms covers the whole wait, so the clock polls once per pass (no real sleep).
    bodies = Prebuilder(prepare, specs, budget_bytes=1, monotonic=turns)
    clock = Clock(1.0, spin_ms=1000.0, monotonic=turns, origin=turns.now + 0.05)
    done: list[RequestRecord] = []
    await _open_loop(cast(Any, StandInClient(turns, log)), clock, specs, 1.0, bodies, done.append)

    assert [r.request_id for r in sorted(done, key=lambda r: r.request_id)] == [s.request_id for s in specs]
    assert [(kind, rid) for kind, rid, _ in log] == [
        ("build", "r0"), ("build", "r1"), ("build", "r2"), ("send", "r0"), ("send", "r1"), ("send", "r2"),
        ("build", "r3"), ("build", "r4"), ("send", "r3"), ("send", "r4"),
        ("build", "r5"), ("send", "r5")]
    started = {rid: turn for kind, rid, turn in log if kind == "send"}
    assert started["r0"] == started["r1"] == started["r2"] < started["r3"] == started["r4"] < started["r5"]
    # Each burst went out within a pass of its deadline (origin + 50 ms + arrival, 1 ms per pass).
    assert started["r3"] - started["r0"] in (100, 101) and started["r5"] - started["r3"] in (100, 101)
