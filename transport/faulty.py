"""Seeded fault injection around any transport: drop, delay, bandwidth cap, truncate, corrupt, reset, hang.

Each push and pull draws at most one fault from ``FaultPlan.rates`` with the plan's seeded RNG (so a
run replays exactly, given the same call order). What each fault does:

- ``drop``: the transfer's bytes vanish; the caller hears nothing until its deadline
  (``TransferTimeout``), as with a lost message.
- ``delay``: the call starts ``delay_ms`` (emulated, uniform in the range) late, then proceeds.
- ``bandwidth``: the real bytes are throttled to ``bandwidth_bytes_per_s`` (a wall-clock wait).
- ``truncate``: one block's payload is cut short in flight.
- ``corrupt``: one byte of one block's payload is flipped in flight (on a copy; the caller's buffer
  is never written).
- ``reset``: the backend's connection to the peer is reset mid-transfer (``abort_connections``),
  which fails the other transfers on that connection too; a backend without connections (``inproc``)
  loses the call as it starts.
- ``hang``: the peer stops answering: a push's bytes are staged but never committed, a pull never
  completes, until the deadline.

At run time ``switch`` replaces the plan (a fault schedule's ``transfer_faults`` period; ``None`` or an
empty plan: no fault drawn) and ``cut``/``heal`` sever this endpoint from peers by their location, as a
network partition would: a push or pull to a cut peer fails at once with ``PeerGone`` (connection refused).

Truncation and corruption keep the checksum of the original bytes, which the receiving backend
verifies, so they surface as ``IntegrityError``. For a pull they are injected where the bytes leave:
in ``publish`` of the serving endpoint's wrapper, which offers tampered copies (each publish draws
from the same rates; other kinds do nothing there).

Guarantee (tested, and counted by ``bench/transport.py``): every transfer through the wrapper either
delivers bytes identical to those sent or raises a typed ``TransportError`` by its deadline.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import Field, model_validator

from config.base import Frozen, NonNegativeFloat, PositiveFloat
from transport.base import (
    Abortable,
    Address,
    Block,
    BlockId,
    Delivery,
    Gate,
    KVTransport,
    PeerGone,
    RequestId,
    SizeHook,
    TransferRecord,
    TransferTimeout,
    TransportStats,
)
from transport.endpoint import within

FaultKind = Literal["drop", "delay", "bandwidth", "truncate", "corrupt", "reset", "hang"]
FAULT_KINDS: tuple[FaultKind, ...] = ("drop", "delay", "bandwidth", "truncate", "corrupt", "reset", "hang")
TAMPER_KINDS = ("truncate", "corrupt")
T = TypeVar("T")


class FaultPlan(Frozen):
    """Which faults to inject, how often (probability per transfer), and how hard."""

    seed: int = 0
    rates: dict[FaultKind, float] = Field(default_factory=dict)
    delay_ms: tuple[NonNegativeFloat, NonNegativeFloat] = (1.0, 20.0)
    """Range of an injected delay, emulated ms."""
    bandwidth_bytes_per_s: PositiveFloat = 200e6
    """Real throughput while a bandwidth cap applies."""
    reset_after_ms: tuple[NonNegativeFloat, NonNegativeFloat] = (0.0, 2.0)
    """When, after the call starts, a reset hits (wall ms)."""

    @model_validator(mode="after")
    def _valid(self) -> FaultPlan:
        if any(not 0.0 <= p <= 1.0 for p in self.rates.values()):
            raise ValueError("every fault rate must be within [0, 1]")
        if sum(self.rates.values()) > 1.0 + 1e-9:
            raise ValueError("fault rates must add up to at most 1 (one fault per transfer)")
        for name in ("delay_ms", "reset_after_ms"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"{name} must be a range (low, high) with low <= high")
        return self

    @staticmethod
    def every_kind(total: float, seed: int = 0, **kw: object) -> FaultPlan:
        """Each kind at ``total / 7``."""
        return FaultPlan.model_validate({"seed": seed, "rates": {k: total / len(FAULT_KINDS) for k in FAULT_KINDS},
                                         **kw})


class FaultyTransport:
    """A transport that injects the faults of a :class:`FaultPlan` (see the module docstring)."""

    def __init__(self, inner: KVTransport, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.name = inner.name
        self.site = inner.site
        self.clock = inner.clock
        self.rng = random.Random(plan.seed)
        self.injected: Counter[str] = Counter()
        self.cut_off: set[str] = set()
        """Peer locations this endpoint cannot reach (a partition)."""

    def switch(self, plan: FaultPlan | None) -> None:
        """From now on inject ``plan``'s faults (its seed restarts the draws); None: none."""
        self.plan = plan or FaultPlan()
        self.rng = random.Random(self.plan.seed)

    def cut(self, locations: Iterable[str]) -> None:
        self.cut_off.update(locations)

    def heal(self, locations: Iterable[str] | None = None) -> None:
        """Reconnect to ``locations`` (None: every peer)."""
        if locations is None:
            self.cut_off.clear()
        else:
            self.cut_off.difference_update(locations)

    def _refuse_if_cut(self, address: Address, what: str) -> None:
        if address.location in self.cut_off:
            self.injected["partition"] += 1
            raise PeerGone(f"{what}: {address} is unreachable (network partition)")

    def _draw(self) -> FaultKind | None:
        if not self.plan.rates:
            return None
        x = self.rng.random()
        for kind in FAULT_KINDS:
            x -= self.plan.rates.get(kind, 0.0)
            if x < 0:
                return kind
        return None

    def deadline(self, deadline_ms: float | None) -> float:
        return self.inner.deadline(deadline_ms)

    async def serve(self) -> Address:
        return await self.inner.serve()

    # -- tampering -------------------------------------------------------------------------------
    def _tamper(self, kind: FaultKind, blocks: Sequence[Block]) -> list[Block] | None:
        """Blocks with one truncated or corrupted (original checksums kept), or None if none has bytes."""
        candidates = [i for i, b in enumerate(blocks) if b.nbytes > 0]
        if not candidates:
            return None
        out = [b.with_checksum() for b in blocks]
        i = self.rng.choice(candidates)
        b = out[i]
        if kind == "truncate":
            payload = b.payload[: self.rng.randrange(b.nbytes)]
        else:
            copy = bytearray(b.payload)
            copy[self.rng.randrange(len(copy))] ^= self.rng.randrange(1, 256)
            payload = memoryview(copy)
        out[i] = Block(b.block_id, payload, b.layers, b.checksum, b.checksum_algo)
        return out

    # -- calls -----------------------------------------------------------------------------------
    async def push(self, address: Address, request_id: RequestId, blocks: Sequence[Block], *,
                   deadline_ms: float | None = None, gate: Gate | None = None) -> TransferRecord:
        self._refuse_if_cut(address, f"push {request_id!r}")
        kind = self._draw()
        dl = self.deadline(deadline_ms)
        what = f"push {request_id!r} to {address} ({kind or 'no'} fault injected)"
        if kind in TAMPER_KINDS:
            assert kind is not None
            tampered = self._tamper(kind, blocks)
            if tampered is None:
                kind = None
            else:
                blocks = tampered
        if kind is not None:
            self.injected[kind] += 1
        if kind == "drop":
            await self._never(dl, what)
        if kind == "hang":
            return await self.inner.push(address, request_id, blocks, deadline_ms=dl, gate=_never_opens)
        if kind in ("delay", "bandwidth"):
            await self._wait_before(kind, sum(b.nbytes for b in blocks), dl, what)
        if kind == "reset":
            return await self._with_reset(address, dl, what, self.inner.push(
                address, request_id, blocks, deadline_ms=dl, gate=gate))
        return await self.inner.push(address, request_id, blocks, deadline_ms=dl, gate=gate)

    async def pull(self, address: Address, request_id: RequestId, block_ids: Sequence[BlockId], *,
                   deadline_ms: float | None = None, on_size: SizeHook | None = None) -> Delivery:
        self._refuse_if_cut(address, f"pull {request_id!r}")
        kind = self._draw()
        if kind in TAMPER_KINDS:
            kind = None  # injected by the serving side's publish
        dl = self.deadline(deadline_ms)
        what = f"pull {request_id!r} from {address} ({kind or 'no'} fault injected)"
        if kind is not None:
            self.injected[kind] += 1
        if kind in ("drop", "hang"):
            await self._never(dl, what)
        if kind == "delay":
            await self._wait_before(kind, 0, dl, what)
        if kind == "reset":
            return await self._with_reset(address, dl, what, self.inner.pull(
                address, request_id, block_ids, deadline_ms=dl, on_size=on_size))
        delivery = await self.inner.pull(address, request_id, block_ids, deadline_ms=dl, on_size=on_size)
        if kind == "bandwidth":
            try:
                async with within(self.clock, dl, what):
                    await asyncio.sleep(delivery.nbytes / self.plan.bandwidth_bytes_per_s)
            except BaseException:
                delivery.release()
                raise
        return delivery

    async def _never(self, dl: float, what: str) -> None:
        async with within(self.clock, dl, what):
            await asyncio.get_running_loop().create_future()
        raise TransferTimeout(f"{what}: never answered")  # pragma: no cover (the future never completes)

    async def _wait_before(self, kind: FaultKind, nbytes: int, dl: float, what: str) -> None:
        async with within(self.clock, dl, what):
            if kind == "delay":
                await self.clock.sleep_until(self.clock.now_ms() + self.rng.uniform(*self.plan.delay_ms))
            else:
                await asyncio.sleep(nbytes / self.plan.bandwidth_bytes_per_s)

    async def _with_reset(self, address: Address, dl: float, what: str, call: Coroutine[Any, Any, T]) -> T:
        """Run ``call``; part-way through, reset the backend's connection to ``address`` (or interrupt it)."""
        after_s = self.rng.uniform(*self.plan.reset_after_ms) / 1000.0
        if not isinstance(self.inner, Abortable):  # no connection to reset: the call is lost as it starts
            call.close()
            raise PeerGone(f"{what}: connection reset")
        task = asyncio.get_running_loop().create_task(call)
        handed = False
        try:
            async with within(self.clock, dl, what):
                done, _ = await asyncio.wait({task}, timeout=after_s)
                if not done:
                    if not (isinstance(self.inner, Abortable) and self.inner.abort_connections(address) > 0):
                        task.cancel()  # nothing to reset in process: interrupt the call instead
                    await asyncio.wait({task})
                    if task.cancelled():
                        raise PeerGone(f"{what}: connection reset")
                result = task.result()
                handed = True
                return result
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
            if not handed and not task.cancelled() and task.exception() is None:
                leftover = task.result()
                if isinstance(leftover, Delivery):
                    leftover.release()

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None:
        blocks = list(blocks)
        kind = self._draw()
        if kind in TAMPER_KINDS:
            assert kind is not None
            tampered = self._tamper(kind, blocks)
            if tampered is not None:
                self.injected[f"{kind}@publish"] += 1
                blocks = tampered
        self.inner.publish(request_id, blocks)

    def withdraw(self, request_id: RequestId) -> None:
        self.inner.withdraw(request_id)

    async def receive(self, request_id: RequestId, *, count: int = 1, deadline_ms: float | None = None) -> Delivery:
        return await self.inner.receive(request_id, count=count, deadline_ms=deadline_ms)

    def discard(self, request_id: RequestId) -> None:
        self.inner.discard(request_id)

    def abort_connections(self, address: Address) -> int:
        return self.inner.abort_connections(address) if isinstance(self.inner, Abortable) else 0

    def stats(self) -> TransportStats:
        return self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


async def _never_opens() -> None:
    await asyncio.get_running_loop().create_future()

