"""KV tiers alone (no engine): byte-exact round trips, eviction and spill, integrity, the chain's timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.engine.kv_blocks import BlockHash, BlockRemoved, BlockStored, KVEvent
from actors.engine.tiers.base import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    KVTier,
    TierIntegrity,
    TierMiss,
)
from actors.engine.tiers.chain import TierChain
from actors.engine.tiers.cpu import CPUTier
from actors.engine.tiers.disk import HEADER, DiskTier
from actors.engine.tiers.faulty import FaultyTier
from actors.engine.tiers.payload import BlockPayloads
from actors.engine.tiers.policies import POLICIES, make_policy
from config.tiers import EVICTION_POLICIES, tier_devices
from tests.virtual_clock import VirtualClock

PCIE5 = tier_devices()["pcie-gen5-x16"]
NVME4 = tier_devices()["nvme-gen4"]
EMU_BLOCK = 16 * 131_072.0  # 16 tokens of Llama-3-8B-like KV (128 KiB per token)
PAYLOADS = BlockPayloads(EMU_BLOCK, 1 / 64)


def keys(n: int, start: int = 1) -> list[BlockHash]:
    return [BlockHash(0x1000 + i) for i in range(start, start + n)]


def cpu(cap: int, policy: str = "lru") -> CPUTier:
    return CPUTier(cap, PCIE5, make_policy(policy))


def disk(tmp_path: Path, cap: int) -> DiskTier:
    return DiskTier(cap, NVME4, make_policy("lru"), tmp_path, "e0")


def test_policy_registry_matches_config() -> None:
    assert set(POLICIES) == set(EVICTION_POLICIES)
    with pytest.raises(ValueError, match="known: fifo, lfu, lru"):
        make_policy("mru")


@pytest.mark.parametrize("policy, expected", [("lru", [2, 1]), ("fifo", [1, 2]), ("lfu", [2, 4])])
def test_eviction_order_by_policy(policy: str, expected: list[int]) -> None:
    p = make_policy(policy)
    for k in (1, 2, 3, 1, 4):  # 1 read again after 3 arrived
        p.touch(BlockHash(k))
    for _ in range(2):
        p.touch(BlockHash(3))  # 3 becomes the most used (LFU keeps it), and the most recent
    out = []
    for _ in range(2):
        v = p.victim()
        p.forget(v)
        out.append(int(v))
    assert out == expected


async def _round_trip(tier: KVTier) -> None:
    ks = keys(5)
    blocks = [(k, PAYLOADS.payload(k)) for k in ks]
    res = await tier.put(blocks)
    assert res.stored == tuple(ks) and not res.evicted
    assert tier.lookup(ks) == 5 and tier.lookup([BlockHash(7), *ks]) == 0
    got = await tier.get(ks)
    assert got == [p for _, p in blocks]
    assert all(PAYLOADS.matches(k, g) for k, g in zip(ks, got, strict=True))
    with pytest.raises(TierMiss):
        await tier.get([*ks[:2], BlockHash(99)])
    assert tier.usage().blocks == 5
    assert tier.usage().real_bytes == 5 * PAYLOADS.block_bytes


async def test_cpu_tier_round_trip_byte_exact() -> None:
    await _round_trip(cpu(8))


async def test_disk_tier_round_trip_byte_exact_real_files(tmp_path: Path) -> None:
    t = disk(tmp_path, 8)
    await _round_trip(t)
    files = sorted((tmp_path / "e0").glob("*.kv"))
    assert len(files) == 5
    assert files[0].stat().st_size == HEADER.size + PAYLOADS.block_bytes
    await t.close()
    assert (tmp_path / "e0").exists()  # a folder it was given is kept; only its own temp folder is removed


async def test_disk_tier_detects_corrupt_file_and_forgets_it(tmp_path: Path) -> None:
    t = disk(tmp_path, 8)
    ks = keys(3)
    await t.put([(k, PAYLOADS.payload(k)) for k in ks])
    path = t.path_of(ks[1])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(TierIntegrity):
        await t.get(ks)
    assert t.lookup(ks) == 1 and not path.exists()
    assert await t.get(ks[:1]) == [PAYLOADS.payload(ks[0])]


async def test_cpu_tier_evicts_lru_and_spills_payloads() -> None:
    t = cpu(3)
    ks = keys(4)
    await t.put([(k, PAYLOADS.payload(k)) for k in ks[:3]])
    await t.get(ks[:1])  # refresh the first
    res = await t.put([(ks[3], PAYLOADS.payload(ks[3]))])
    assert res.evicted == (ks[1],)
    assert res.spill == ((ks[1], PAYLOADS.payload(ks[1])),)
    assert t.usage().blocks == 3


def chain_of(clock: VirtualClock, *tiers: KVTier, timeout: float = 2.0) -> TierChain:
    return TierChain(list(tiers), PAYLOADS, PCIE5, clock, block_size=16, io_timeout_s=timeout)


async def test_chain_writes_down_spills_to_disk_and_loads_from_both(tmp_path: Path) -> None:
    clock = VirtualClock()
    chain = chain_of(clock, cpu(2), disk(tmp_path, 8))
    chain.start()
    ks = keys(4)
    chain.write_down(ks[:2])
    assert chain.lookup(ks) == 2  # staged blocks are visible at once
    await chain.flush()
    chain.write_down(ks[2:])
    await chain.flush()
    # CPU holds the last two; the first two were spilled to disk.
    assert [chain.level_of(k) for k in ks] == [1, 1, 0, 0]
    events = chain.take_events()
    stored = [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockStored)]
    removed = [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockRemoved)]
    assert (MEDIUM_DISK, tuple(ks[:2])) in stored and (MEDIUM_CPU, tuple(ks[:2])) in removed
    ticket = chain.start_load(ks, 64)
    assert ticket.task is not None
    await ticket.task
    assert ticket.error is None and chain.finish_load(ticket)
    nbytes = 2 * EMU_BLOCK
    cpu_s = PCIE5.transfer_s(nbytes, False)
    disk_s = NVME4.transfer_s(nbytes, False) + PCIE5.transfer_s(nbytes, False)
    assert ticket.ready_ms == pytest.approx(0.0 + (cpu_s + disk_s) * 1000.0)
    assert chain.stats[MEDIUM_CPU].load_blocks == 2 and chain.stats[MEDIUM_DISK].load_blocks == 2
    await chain.close()


async def test_chain_loads_queue_on_the_host_link() -> None:
    clock = VirtualClock()
    chain = chain_of(clock, cpu(16))
    chain.start()
    ks = keys(8)
    chain.write_down(ks)
    await chain.flush()
    a = chain.start_load(ks[:4], 64)
    b = chain.start_load(ks[4:], 64)
    one = PCIE5.transfer_s(4 * EMU_BLOCK, False) * 1000.0
    assert a.ready_ms == pytest.approx(one) and b.ready_ms == pytest.approx(2 * one)
    await asyncio.gather(*(t.task for t in (a, b) if t.task is not None))
    await chain.close()


@pytest.mark.parametrize("fault, reason", [("fail", "TierIOError"), ("corrupt", "TierIntegrity"),
                                           ("hang", "TierTimeout")])
async def test_chain_load_fails_cleanly(fault: str, reason: str) -> None:
    clock = VirtualClock()
    inner = cpu(8)
    chain = chain_of(clock, FaultyTier(inner, "ok"), timeout=0.05)
    chain.start()
    ks = keys(3)
    chain.write_down(ks)
    await chain.flush()
    tier = chain.tiers[0]
    assert isinstance(tier, FaultyTier)
    tier.set(fault)  # type: ignore[arg-type]
    ticket = chain.start_load(ks, 48)
    assert ticket.task is not None
    await ticket.task
    assert ticket.error is not None and ticket.error.startswith(reason)
    assert not chain.finish_load(ticket)
    assert chain.stats[MEDIUM_CPU].fallbacks == 1
    assert chain.fallback_reasons[(MEDIUM_CPU, reason)] == 1
    await chain.close()


async def test_private_swap_keys_are_not_announced() -> None:
    chain = chain_of(VirtualClock(), cpu(4))
    chain.start()
    chain.write_down([BlockHash(5)], private=True)
    chain.write_down([BlockHash(6)])
    await chain.flush()
    ev = chain.take_events()
    assert [e.block_hashes for e in ev if isinstance(e, BlockStored)] == [(BlockHash(6),)]
    await chain.close()


def test_feed_events_carry_the_medium_of_lower_tiers() -> None:
    from actors.feed import encode_events

    evs: list[KVEvent] = [BlockStored((BlockHash(1),), None, 16),
                          BlockStored((BlockHash(2),), BlockHash(1), 16, MEDIUM_CPU),
                          BlockRemoved((BlockHash(3),), MEDIUM_DISK), BlockRemoved((BlockHash(4),))]
    assert encode_events(evs) == [["stored", [1], None], ["stored", [2], 1, "CPU"], ["removed", [3], "DISK"],
                                  ["removed", [4]]]


async def test_chain_snapshot_lists_public_keys_by_medium(tmp_path: Path) -> None:
    chain = chain_of(VirtualClock(), cpu(1), disk(tmp_path, 4))
    chain.start()
    chain.write_down(keys(2))
    chain.write_down([BlockHash(77)], private=True)
    await chain.flush()
    held = chain.held()
    assert sorted(held) == [MEDIUM_CPU, MEDIUM_DISK]
    assert sorted(held[MEDIUM_CPU] + held[MEDIUM_DISK]) == sorted(int(k) for k in keys(2))
    await chain.close()


async def test_load_finds_blocks_that_moved_down_after_it_started(tmp_path: Path) -> None:
    """The load's own GPU allocation writes blocks down, which can push the blocks being loaded from the CPU
    tier to disk before the read begins: the load locates them again instead of failing."""
    chain = chain_of(VirtualClock(), cpu(2), disk(tmp_path, 8))
    chain.start()
    ks = keys(4)
    chain.write_down(ks[:2])
    await chain.flush()
    chain.write_down(ks[2:])  # as try_load's allocation does: queued first, it evicts both to disk ...
    ticket = chain.start_load(ks[:2], 32)  # ... after they were located in the CPU tier
    assert ticket.task is not None
    await ticket.task
    assert ticket.error is None and chain.finish_load(ticket)
    await chain.close()


def test_tier_config_is_checked_at_load() -> None:
    from pydantic import ValidationError

    from config.cluster import EngineGroupSpec
    from config.tiers import CPUTierSpec, DiskTierSpec, TiersSpec

    with pytest.raises(ValidationError, match="needs a cpu tier"):
        TiersSpec(preemption="swap")
    with pytest.raises(ValidationError, match="unknown host-link preset 'nvme-gen4'"):
        TiersSpec(cpu=CPUTierSpec(capacity_gb=1, link="nvme-gen4"))
    with pytest.raises(ValidationError, match="unknown nvme preset"):
        TiersSpec(disk=DiskTierSpec(capacity_gb=1, device="floppy"))
    with pytest.raises(ValidationError, match="unknown eviction policy 'mru'"):
        CPUTierSpec(capacity_gb=1, policy="mru")
    with pytest.raises(ValidationError, match=r"need scheduler\.enable_prefix_caching"):
        EngineGroupSpec.model_validate({"name": "g", "model": "m", "scheduler": {"enable_prefix_caching": False},
                                        "tiers": {"cpu": {"capacity_gb": 1}}})
    assert not TiersSpec().enabled
