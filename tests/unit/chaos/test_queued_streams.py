"""The soak's hang (2026-11-30), reproduced on the virtual clock without Ray: streams cut by a kill were
continued on a fresh engine, which then served nothing until their clients gave up.

Cause: an engine stamps a request's arrival when its handler starts, before reading the body, so of two
continuations sent together the one with the bigger body (a 46k-token prompt) is queued after a smaller one
stamped later. An idle engine planned its step from the earliest arrival; the queue's head had arrived after
that, so nothing was admitted, and the engine slept until something it could admit came, which never did:
every later request queued behind the same head (5 streams hung to the client's 120 s deadline, and the
requests behind them waited ~114 s for a first token). Each test checks every request completes, with its
first token no earlier than its arrival.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from actors.cost_model import EmpiricalCostModel
from actors.engine.engine import Engine, EngineConfig, RequestStream
from actors.engine.scheduler import SchedulerLimits
from config import default_catalog
from tests.virtual_clock import VirtualClock

LESSON = default_catalog().profiles.get("lesson-70b-fp8")


def engine(clock: VirtualClock) -> Engine:
    cfg = EngineConfig("e0", "lesson", "colocated", 4096, 16, SchedulerLimits(256, 8192, 100_000))
    return Engine(cfg, EmpiricalCostModel(LESSON, "colocated"), clock)


async def tokens(stream: RequestStream) -> int:
    return sum([len(ev.token_ids) async for ev in stream])


async def served(scenario: Callable[[Engine, VirtualClock], Awaitable[list[RequestStream]]]) -> list[int]:
    """Tokens each stream of ``scenario`` got on a fresh engine (a deadlock fails the run); no block leaked."""
    clock = VirtualClock()
    eng = engine(clock)
    eng.start()

    async def run() -> list[int]:
        streams = await scenario(eng, clock)
        out = list(await asyncio.gather(*(tokens(s) for s in streams)))
        for s in streams:
            assert s.seq.first_token_ms is not None and s.seq.first_token_ms > s.seq.arrival_ms
        return out

    try:
        return await clock.run(run(), limit_ms=10_000)
    finally:
        await eng.stop()
        assert eng.kv.pool.num_free == eng.cfg.num_blocks


async def test_an_idle_engine_admits_a_head_queued_ahead_of_an_earlier_arrival() -> None:
    async def scenario(eng: Engine, clock: VirtualClock) -> list[RequestStream]:
        await clock.sleep_for(10.0)
        return [eng.submit(list(range(100, 200)), 5, ignore_eos=True, arrival_ms=9.0),  # small body, read first
                eng.submit(list(range(300, 400)), 5, ignore_eos=True, arrival_ms=4.0)]

    assert await served(scenario) == [5, 5]


async def test_requests_queued_behind_such_a_head_are_served_too() -> None:
    async def scenario(eng: Engine, clock: VirtualClock) -> list[RequestStream]:
        await clock.sleep_for(50.0)
        streams = [eng.submit(list(range(100, 200)), 3, ignore_eos=True, arrival_ms=40.0),
                   eng.submit(list(range(300, 400)), 3, ignore_eos=True, arrival_ms=20.0)]
        await clock.sleep_for(30.0)  # later arrivals wake the engine: each must find it admitting
        return streams + [eng.submit(list(range(500 + 100 * k, 600 + 100 * k)), 3, ignore_eos=True)
                          for k in range(3)]

    assert await served(scenario) == [3] * 5
