"""A tier wrapper that fails on demand (tests, chaos): every KVTier call passes through unless a fault is on.

Faults (switch at run time with ``set``): ``fail`` (get and put raise ``TierIOError``), ``hang`` (get never
answers: the chain's I/O timeout must end it), ``corrupt`` (get returns the right number of blocks with
one byte flipped in each: the chain's payload check must catch it), ``ok`` (pass through).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from actors.engine.kv_blocks import BlockHash
from actors.engine.tiers.base import KVTier, PutResult, TierIOError, TierUsage

Fault = Literal["ok", "fail", "hang", "corrupt"]


async def _fail(tier: KVTier, hashes: Sequence[BlockHash]) -> list[bytes]:
    raise TierIOError(tier.name, "injected failure")


async def _hang(tier: KVTier, hashes: Sequence[BlockHash]) -> list[bytes]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _corrupt(tier: KVTier, hashes: Sequence[BlockHash]) -> list[bytes]:
    out = await tier.get(hashes)
    return [bytes([b[0] ^ 0xFF]) + b[1:] if b else b for b in out]


async def _pass(tier: KVTier, hashes: Sequence[BlockHash]) -> list[bytes]:
    return await tier.get(hashes)


GETS: dict[str, Callable[[KVTier, Sequence[BlockHash]], Awaitable[list[bytes]]]] = {
    "ok": _pass, "fail": _fail, "hang": _hang, "corrupt": _corrupt}


class FaultyTier:
    """Wraps ``inner`` (same name and medium); ``fault`` picks how its reads misbehave (see the module)."""

    def __init__(self, inner: KVTier, fault: Fault = "ok") -> None:
        self.inner = inner
        self.name = inner.name
        self.medium = inner.medium
        self.fault: Fault = fault
        self.gets = 0

    def set(self, fault: Fault) -> None:
        self.fault = fault

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.inner.lookup(hashes)

    async def put(self, blocks: Sequence[tuple[BlockHash, bytes]]) -> PutResult:
        if self.fault == "fail":
            raise TierIOError(self.name, "injected failure")
        return await self.inner.put(blocks)

    async def get(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        self.gets += 1
        return await GETS[self.fault](self.inner, hashes)

    def transfer_s(self, nbytes: int, write: bool) -> float:
        return self.inner.transfer_s(nbytes, write)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    async def close(self) -> None:
        await self.inner.close()
