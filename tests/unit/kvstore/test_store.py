"""The shared KV store: the block table (capacity, eviction, checksums, change log), its server and the
engine's tier client over the in-process transport (no Ray, no sockets)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import KVTier, TierIntegrity, TierIOError, TierMiss
from actors.kvstore.client import StoreTier
from actors.kvstore.server import StoreServer
from actors.kvstore.store import BlockStore, Changes
from config.link import LinkProfile
from tests.unit.transport.conftest import VirtualClock
from transport import Site
from transport.inproc import InprocHub, InprocTransport

LINK = LinkProfile(name="test-nic", source="test", kind="rdma", bandwidth_gbps=50.0, latency_us=5.0)


def payloads(n: int, size: int, seed: int = 0) -> list[tuple[BlockHash, bytes]]:
    rng = random.Random(seed)
    return [(BlockHash(rng.getrandbits(64) or 1), rng.randbytes(size)) for _ in range(n)]


# -- BlockStore -----------------------------------------------------------------------------------
def test_round_trip_byte_exact_and_all_or_nothing() -> None:
    s = BlockStore(capacity_bytes=10_000)
    blocks = payloads(4, 1000)
    assert s.put(blocks).stored == tuple(h for h, _ in blocks)
    assert s.get([h for h, _ in blocks]) == [p for _, p in blocks]
    with pytest.raises(TierMiss):
        s.get([blocks[0][0], BlockHash(12345), blocks[1][0]])
    assert s.lookup([blocks[0][0], blocks[1][0], BlockHash(12345), blocks[2][0]]) == 2


def test_capacity_evicts_least_recently_used_first() -> None:
    s = BlockStore(capacity_bytes=3000)
    (a, pa), (b, pb), (c, pc), (d, pd) = payloads(4, 1000)
    s.put([(a, pa), (b, pb), (c, pc)])
    s.get([a])  # a is now the most recent: b goes first
    r = s.put([(d, pd)])
    assert r.evicted == (b,)
    assert s.used_bytes == 3000 and len(s) == 3
    assert b not in s and a in s and d in s
    assert s.put([(BlockHash(9), b"x" * 3001)]).stored == ()  # larger than the store: refused, nothing evicted
    assert len(s) == 3 and s.refused == 1


def test_corruption_at_rest_fails_the_get_and_drops_the_block() -> None:
    s = BlockStore(capacity_bytes=10_000)
    (a, pa), (b, pb) = payloads(2, 100)
    s.put([(a, pa), (b, pb)])
    s.corrupt_for_test(b)
    with pytest.raises(TierIntegrity):
        s.get([a, b])
    assert b not in s and s.corrupt == 1
    assert s.get([a]) == [pa]


def test_change_log_incremental_then_reset_when_too_old() -> None:
    s = BlockStore(capacity_bytes=2000, log_limit=4)
    (a, pa), (b, pb), (c, pc) = payloads(3, 1000)
    s.put([(a, pa)])
    v1 = s.version
    s.put([(b, pb)])
    ch = s.changes_since(v1)
    assert ch == Changes(s.version, (b,), ())
    s.put([(c, pc)])  # evicts a
    ch = s.changes_since(v1)
    assert set(ch.added) == {b, c} and ch.removed == (a,) and not ch.reset
    for h, p in payloads(6, 1000, seed=1):
        s.put([(h, p)])
    full = s.changes_since(v1)
    assert full.reset and set(full.added) == set(s.keys())
    assert s.changes_since(s.version) == Changes(s.version)


# -- server and client over the transport ---------------------------------------------------------
@dataclass
class Rig:
    primary: StoreServer
    replica: StoreServer
    tier: StoreTier
    client_transport: InprocTransport


class Direct:
    """The server itself as the index source (the actor's Ray call in a cluster)."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.down = False

    async def changes_since(self, since: int) -> Changes:
        if self.down:
            raise ConnectionError("store actor is dead")
        return self.server.changes_since(since)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    clock = VirtualClock()
    hub = InprocHub()
    replica = StoreServer(BlockStore(1 << 20, name="replica"), InprocTransport(Site("s2", "r"), clock, hub=hub))
    raddr = await replica.start()
    primary = StoreServer(BlockStore(1 << 20, name="primary"), InprocTransport(Site("s1", "r"), clock, hub=hub),
                          replica=raddr)
    paddr = await primary.start()
    ct = InprocTransport(Site("gpu0", "r"), clock, hub=hub)
    tier = StoreTier(ct, [(paddr, Direct(primary)), (raddr, Direct(replica))], LINK, timeout_ms=1000.0)
    yield Rig(primary, replica, tier, ct)
    await tier.close()
    await primary.close()
    await replica.close()
    await ct.close()


async def settle(*servers: StoreServer, blocks: int) -> None:
    """Until every server's store holds ``blocks`` blocks (ingest and replication run as tasks)."""
    for _ in range(200):
        if all(len(s.store) >= blocks for s in servers):
            return
        await asyncio.sleep(0)
    raise AssertionError([len(s.store) for s in servers])


async def test_tier_round_trip_byte_exact_through_the_store(rig: Rig) -> None:
    assert isinstance(rig.tier, KVTier)
    blocks = payloads(8, 4096, seed=3)
    hashes = [h for h, _ in blocks]
    await rig.tier.put(blocks)
    await settle(rig.primary, rig.replica, blocks=8)
    await rig.tier.sync()
    assert rig.tier.lookup(hashes) == 8
    got = await rig.tier.get(hashes)
    assert got == [p for _, p in blocks]
    assert rig.primary.verify_offers() and rig.replica.verify_offers()
    assert rig.client_transport.stats().pool_leases == 0


async def test_get_is_complete_or_fails_never_partial(rig: Rig) -> None:
    blocks = payloads(4, 512, seed=4)
    await rig.tier.put(blocks)
    await settle(rig.primary, rig.replica, blocks=4)
    await rig.tier.sync()
    with pytest.raises(TierMiss):
        await rig.tier.get([blocks[0][0], BlockHash(77), blocks[1][0]])
    rig.primary.corrupt_for_test(blocks[2][0])
    rig.replica.corrupt_for_test(blocks[2][0])
    with pytest.raises(TierIntegrity):
        await rig.tier.get([h for h, _ in blocks])
    assert await rig.tier.get([blocks[0][0], blocks[1][0]]) == [blocks[0][1], blocks[1][1]]


async def test_a_dead_store_fails_over_to_its_replica_then_degrades_to_a_miss(rig: Rig) -> None:
    blocks = payloads(4, 512, seed=5)
    hashes = [h for h, _ in blocks]
    await rig.tier.put(blocks)
    await settle(rig.primary, rig.replica, blocks=4)
    await rig.tier.sync()
    await rig.primary.close()  # killed: its endpoint is gone
    assert await rig.tier.get(hashes) == [p for _, p in blocks]  # the replica answers
    await rig.replica.close()
    with pytest.raises(TierIOError):
        await rig.tier.get(hashes)
    for s in rig.tier.stores:
        assert isinstance(s.index, Direct)
        s.index.down = True
    await rig.tier.sync()
    assert rig.tier.lookup(hashes) == 0  # out of the view: the engine stops counting on the store
    with pytest.raises(TierMiss):
        await rig.tier.get(hashes)


async def test_eviction_in_the_store_reaches_the_view_and_the_events(rig: Rig) -> None:
    changes: list[tuple[list[BlockHash], list[BlockHash]]] = []
    rig.tier.on_change = lambda added, removed: changes.append((list(added), list(removed)))
    small = StoreServer(BlockStore(2048, name="small"), InprocTransport(Site("s3", "r"), rig.primary.endpoint.clock,
                                                                         hub=rig.client_transport.hub))
    addr = await small.start()
    tier = StoreTier(rig.client_transport, [(addr, Direct(small))], LINK, on_change=rig.tier.on_change)
    (a, pa), (b, pb), (c, pc) = payloads(3, 1024, seed=6)
    await tier.put([(a, pa), (b, pb)])
    await settle(small, blocks=2)
    await tier.put([(c, pc)])
    for _ in range(50):
        await asyncio.sleep(0)
    await tier.sync()
    assert tier.lookup([a]) == 0 and tier.lookup([c]) == 1
    assert any(a in removed for _, removed in changes)
    with pytest.raises(TierMiss):
        await tier.get([a])
    await tier.close()
    await small.close()


def test_transfer_time_is_the_link_time() -> None:
    tier = StoreTier(InprocTransport(Site("x", "r"), VirtualClock()), [(None, None)], LINK)  # type: ignore[list-item]
    assert tier.transfer_s(50_000_000, write=True) == pytest.approx(0.001 + 5e-6)
    assert tier.transfer_s(50_000_000, write=False) == pytest.approx(0.001 + 10e-6)
