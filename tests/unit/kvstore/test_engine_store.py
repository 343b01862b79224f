"""Engines sharing a KV store, on the virtual clock over the in-process transport: a prefix one engine computed
is loaded by another from the store (paying the modelled load, not the prefill), announced with medium STORE;
a store killed mid-run leaves every request served (the load falls back to recompute, same tokens); each
request's store lookup is priced once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from actors.cost_model import EmpiricalCostModel
from actors.engine.engine import Engine, EngineConfig
from actors.engine.kv_blocks import BlockStored, KVEvent, hash_request_blocks
from actors.engine.scheduler import SchedulerLimits
from actors.engine.tiers.base import MEDIUM_STORE
from actors.engine.tiers.overhead import STORE_LOOKUP_MS, ConnectorCostModel
from actors.kvstore.client import StoreTier
from actors.kvstore.engine_side import attach_store
from actors.kvstore.server import StoreServer
from actors.kvstore.store import BlockStore, Changes
from config import default_catalog
from config.link import LinkProfile
from tests.virtual_clock import VirtualClock
from transport import Site
from transport.inproc import InprocHub, InprocTransport

LESSON = default_catalog().profiles.get("lesson-70b-fp8")
LINK = LinkProfile(name="nic", source="test", kind="rdma", bandwidth_gbps=50.0, latency_us=5.0)


class Index:
    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.down = False

    async def changes_since(self, since: int) -> Changes:
        if self.down:
            raise ConnectionError("store actor is dead")
        return self.server.changes_since(since)


@dataclass
class Region:
    server: StoreServer
    index: Index
    engines: list[Engine]
    events: list[list[KVEvent]]
    transports: list[InprocTransport]


@pytest.fixture
async def region() -> AsyncIterator[tuple[VirtualClock, Region]]:
    clock = VirtualClock()
    hub = InprocHub()
    server = StoreServer(BlockStore(1 << 30), InprocTransport(Site("store", "r"), clock, hub=hub))
    addr = await server.start()
    index = Index(server)
    engines, events, transports = [], [], []
    for i in range(2):
        cfg = EngineConfig(f"e{i}", "lesson", "colocated", 4096, 16, SchedulerLimits(256, 8192, 100_000),
                           kv_payload_scale=1 / 256)
        eng = Engine(cfg, EmpiricalCostModel(LESSON, "colocated"), clock)
        t = InprocTransport(Site(f"n{i}", "r"), clock, hub=hub)
        attach_store(eng, StoreTier(t, [(addr, index)], LINK, timeout_ms=500.0, sync_interval_ms=20.0))
        seen: list[KVEvent] = []
        eng.kv_subscribers.append(lambda _s, evs, into=seen: into.extend(evs))  # type: ignore[misc]
        eng.start()
        engines.append(eng)
        events.append(seen)
        transports.append(t)
    yield clock, Region(server, index, engines, events, transports)
    for eng in engines:
        await eng.stop()
    await server.close()
    for t in transports:
        await t.close()
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"
    for eng in engines:
        assert not eng.kv.req_blocks and eng.kv.pool.num_free == eng.cfg.num_blocks


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


async def run(clock: VirtualClock, eng: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    stream = eng.submit(ids, max_tokens, ignore_eos=True, arrival_ms=clock.now_ms())
    toks: list[int] = []
    first = -1.0
    async for ev in stream:
        if ev.token_ids and first < 0:
            first = ev.time_ms
        toks.extend(ev.token_ids)
    return toks, first - stream.seq.arrival_ms


async def until_stored(clock: VirtualClock, r: Region, blocks: int) -> None:
    for _ in range(100):
        if len(r.server.store) >= blocks:
            await clock.sleep_until(clock.now_ms() + 50.0)  # two syncs: every engine's view has them
            return
        await clock.sleep_until(clock.now_ms() + 10.0)
    raise AssertionError(f"the store holds {len(r.server.store)} blocks")


async def test_a_prefix_computed_by_one_engine_is_loaded_by_another(region: tuple[VirtualClock, Region]) -> None:
    clock, r = region
    a, b = r.engines
    p = prompt(1, 960)

    async def scenario() -> tuple[float, float, list[int], list[int]]:
        got_a, cold = await run(clock, a, p, 4)
        await until_stored(clock, r, 59)
        got_b, warm = await run(clock, b, p, 4)
        return cold, warm, got_a, got_b

    cold, warm, got_a, got_b = await clock.run(scenario())
    assert got_a == got_b and len(got_b) == 4
    assert b.tiers is not None
    store = b.tiers.chain.stats[MEDIUM_STORE]
    assert store.load_blocks >= 59 and b.tiers.counters.fallbacks == 0
    assert warm < cold  # a 50 GB/s load beats recomputing 960 tokens of a 70B model
    announced = {h for e in r.events[0] if isinstance(e, BlockStored) and e.medium == MEDIUM_STORE
                 for h in e.block_hashes}
    assert len(announced) >= 59  # the router learns the region's store holds the prefix
    for eng in (a, b):  # each admitted request's store lookup held up one step (LMCache's scheduler path)
        assert isinstance(eng.cost, ConnectorCostModel) and eng.tiers is not None
        assert eng.tiers.counters.lookups == 1
        assert eng.cost.lookup_ms == pytest.approx(STORE_LOOKUP_MS)


async def test_a_store_killed_mid_run_leaves_every_request_served(region: tuple[VirtualClock, Region]) -> None:
    clock, r = region
    a, b = r.engines
    ref_p, other = prompt(2, 960), prompt(3, 640)

    async def scenario() -> tuple[list[int], list[int], list[list[int]]]:
        want, _ = await run(clock, a, ref_p, 8)
        await until_stored(clock, r, 59)
        await r.server.close()  # killed: b still believes the store holds the prefix until its next sync
        got, _ = await run(clock, b, ref_p, 8)
        r.index.down = True
        await clock.sleep_until(clock.now_ms() + 50.0)
        more = await asyncio.gather(*(run(clock, e, other, 4) for e in (a, b)))
        return want, got, [m[0] for m in more]

    want, got, more = await clock.run(scenario())
    assert got == want  # recomputed: the same tokens
    assert b.tiers is not None and b.tiers.counters.fallbacks == 1
    assert all(len(m) == 4 for m in more)
    assert b.tiers.chain.tiers[-1].lookup(hash_request_blocks(ref_p, 16)) == 0  # out of the view
