"""Engine unit-test fixtures: engines on the shared virtual clock, and checks that nothing is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from actors.cost_model import EmpiricalCostModel
from actors.engine.engine import Engine, EngineConfig
from actors.engine.scheduler import SchedulerLimits
from config import default_catalog
from tests.virtual_clock import VirtualClock

LESSON = default_catalog().profiles.get("lesson-70b-fp8")

MakeEngine = Callable[..., Engine]


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
async def make_engine(vclock: VirtualClock) -> AsyncIterator[MakeEngine]:
    """Engines on the virtual clock (lesson-70b-fp8 cost model, 16-token blocks). At teardown each is stopped,
    and must have left no task running, no sequence queued, running, held or reserved, and every KV block
    back in the free pool."""
    made: list[Engine] = []

    def make(blocks: int = 4096, budget: int = 8192, seqs: int = 256) -> Engine:
        cfg = EngineConfig(f"e{len(made)}", "lesson", "colocated", blocks, 16,
                           SchedulerLimits(seqs, budget, 100_000))
        eng = Engine(cfg, EmpiricalCostModel(LESSON, "colocated"), vclock)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        await eng.stop()
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"
    for eng in made:
        name = eng.cfg.name
        sched = eng.scheduler
        assert not (sched.running or sched.waiting or sched.held or sched.unfreed), \
            f"{name} still has sequences: {len(sched.running)} running, {len(sched.waiting)} waiting, " \
            f"{len(sched.held)} held, {len(sched.unfreed)} unfreed"
        assert not eng.reserved and not eng.held_until, f"{name} still has leases"
        assert not eng.kv.req_blocks, f"{name} still maps blocks to requests: {sorted(eng.kv.req_blocks)}"
        assert eng.kv.pool.num_free == eng.cfg.num_blocks, \
            f"{name} leaked {eng.cfg.num_blocks - eng.kv.pool.num_free} KV blocks"
