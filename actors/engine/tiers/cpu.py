"""The CPU DRAM tier: block payloads in process memory, behind the host link (PCIe) preset.

Algorithm: a dict key -> (payload, checksum) bounded by ``capacity_blocks``; ``put`` stores copies and, when
full, evicts the policy's victims first, handing their payloads back as ``spill`` so the chain can write them
to the next tier down (as LMCache's local CPU backend hands evicted chunks to its disk backend). ``get``
checks each payload against the checksum taken at ``put`` (xxh3, the transport's): a mismatch drops that
block and raises ``TierIntegrity``; an absent key raises ``TierMiss``. Nothing here awaits: a CPU tier
operation is atomic with respect to the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import MEDIUM_CPU, PutResult, TierIntegrity, TierMiss, TierUsage
from actors.engine.tiers.policies import EvictionPolicy
from config.tiers import TierDevice
from transport.checksum import xxh3


class CPUTier:
    """CPU DRAM tier (see the module docstring). Invariant: ``len(blocks) <= capacity_blocks`` and the
    policy tracks exactly the keys held."""

    name = "cpu"
    medium = MEDIUM_CPU

    def __init__(self, capacity_blocks: int, link: TierDevice, policy: EvictionPolicy) -> None:
        if capacity_blocks < 1:
            raise ValueError("a CPU tier needs room for at least one block")
        self.capacity_blocks = capacity_blocks
        self.link = link
        self.policy = policy
        self.blocks: dict[BlockHash, tuple[bytes, int]] = {}
        self._real_bytes = 0

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    async def put(self, blocks: Sequence[tuple[BlockHash, bytes]]) -> PutResult:
        stored: list[BlockHash] = []
        evicted: list[BlockHash] = []
        spill: list[tuple[BlockHash, bytes]] = []
        for h, data in blocks:
            if h in self.blocks:
                self.policy.touch(h)
                continue
            while len(self.blocks) >= self.capacity_blocks:
                victim = self.policy.victim()
                self.policy.forget(victim)
                payload, _ = self.blocks.pop(victim)
                self._real_bytes -= len(payload)
                evicted.append(victim)
                spill.append((victim, payload))
            payload = bytes(data)
            self.blocks[h] = (payload, xxh3(payload))
            self._real_bytes += len(payload)
            self.policy.touch(h)
            stored.append(h)
        return PutResult(tuple(stored), tuple(evicted), tuple(spill))

    async def get(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        out: list[bytes] = []
        for h in hashes:
            entry = self.blocks.get(h)
            if entry is None:
                raise TierMiss(self.name, f"block {h:#x} is not held")
            payload, check = entry
            if xxh3(payload) != check:
                self.drop(h)
                raise TierIntegrity(self.name, f"block {h:#x} failed its checksum")
            out.append(payload)
        for h in hashes:
            self.policy.touch(h)
        return out

    def drop(self, h: BlockHash) -> None:
        entry = self.blocks.pop(h, None)
        if entry is not None:
            self._real_bytes -= len(entry[0])
            self.policy.forget(h)

    def transfer_s(self, nbytes: int, write: bool) -> float:
        return self.link.transfer_s(nbytes, write)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.blocks), self.capacity_blocks, self._real_bytes)

    async def close(self) -> None:
        self.blocks.clear()
        self._real_bytes = 0
        while len(self.policy):
            self.policy.forget(self.policy.victim())
