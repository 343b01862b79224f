"""Router unit-test fixtures: a virtual clock, fake engines, and checks that nothing is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from cluster.router.app import RouterServer, RouterSite
from cluster.router.view import WorkerId, WorkerInfo
from config.cluster import RouterSpec
from tests.unit.router.fakes import FakeUpstream
from tests.virtual_clock import VirtualClock


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def upstream() -> FakeUpstream:
    return FakeUpstream()


def workers(n: int, role: str = "colocated", region: str = "local", prefix: str = "w") -> list[WorkerInfo]:
    return [WorkerInfo(WorkerId(f"{prefix}{i}"), f"http://{prefix}{i}", role=role, region=region, model="m",
                       num_blocks=100, free_blocks=100) for i in range(n)]


@pytest.fixture
async def make_router(vclock: VirtualClock,
                      upstream: FakeUpstream) -> AsyncIterator[Callable[..., Awaitable[RouterServer]]]:
    """Routers over the fake engines on the virtual clock; each is stopped, and must have left no request
    open on a worker, no prefill blocks owed, no deadline tracked and no upstream answer unclosed."""
    made: list[RouterServer] = []

    async def make(ws: list[WorkerInfo], site: RouterSite | None = None, **spec: Any) -> RouterServer:
        r = RouterServer(ws, RouterSpec(index_mode="approximate", **spec), site=site, clock=vclock,
                         upstream=upstream, prefill_ms=lambda w, new, cached: new / 100.0)
        await r.start_mechanism()
        made.append(r)
        return r

    yield make
    for r in made:
        await r.stop_mechanism()
        for w in r.view.workers.values():
            assert w.inflight == 0, f"{w.name} still counts {w.inflight} requests in flight"
            assert w.prefilling_blocks == 0, f"{w.name} still owes {w.prefilling_blocks} prefill blocks"
        assert r.deadlines.tracked == 0, "a request's deadline is still tracked"
    assert not upstream.open, f"upstream answers left open: {len(upstream.open)}"


@pytest.fixture(autouse=True)
async def no_tasks_left_behind() -> AsyncIterator[None]:
    yield
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"
