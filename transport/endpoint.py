"""State and calls every backend shares: deadlines (``within``), ``EndpointBase``, the in-flight byte budget."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transport.base import Address, ClockLike, Op, Site, TransferRecord, TransportOptions
from transport.blocks import Block, Delivery, RequestId
from transport.errors import TransferTimeout, TransportClosed, TransportError, translate
from transport.inbox import Inbox, Offers


class Described:
    """What a call is, as its error messages name it ("tcp push 'r1' to tcp://...#n@r"), formatted only when an
    error needs it (formatting an address costs as much as a small push's other bookkeeping)."""

    __slots__ = ("address", "backend", "op", "preposition", "request_id")

    def __init__(self, backend: str, op: str, request_id: RequestId, preposition: str, address: Address) -> None:
        self.backend, self.op, self.request_id, self.preposition, self.address = (
            backend, op, request_id, preposition, address)

    def __str__(self) -> str:
        return f"{self.backend} {self.op} {self.request_id!r} {self.preposition} {self.address}"


# -- deadlines ------------------------------------------------------------------------------------
class within:
    """Run the body until emulated time ``deadline_ms``; past it, cancel the body and raise TransferTimeout.

    The deadline is turned into a wall delay once, on the event loop's timer; backend exceptions that
    escape the body are translated (``translate``), so callers see only typed errors. A class rather than
    a generator-based context manager: it is entered once per transfer, and small pushes count every
    microsecond.
    """

    __slots__ = ("_deadline_ms", "_timeout", "_what")

    def __init__(self, clock: ClockLike, deadline_ms: float, what: object) -> None:
        self._deadline_ms = deadline_ms
        self._what = what
        self._timeout = asyncio.timeout(max(0.0, clock.to_wall_s(deadline_ms - clock.now_ms())))

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        try:
            await self._timeout.__aexit__(et, e, tb)
        except TimeoutError as te:
            raise TransferTimeout(f"{self._what}: missed its deadline ({self._deadline_ms:.3f} emulated ms)") from te
        if e is None or isinstance(e, (asyncio.CancelledError, TransportError)):
            return
        if isinstance(e, TimeoutError):
            raise TransferTimeout(f"{self._what}: missed its deadline ({self._deadline_ms:.3f} emulated ms)") from e
        if isinstance(e, (OSError, EOFError)) or type(e).__name__.startswith("UCX"):
            raise translate(e, str(self._what)) from e


class EndpointBase:
    """State and calls every backend shares: site, clock, options, inbox, offers, deadlines.

    Subclasses implement ``serve``, ``push``, ``pull``, ``close`` and ``stats``.
    """

    name = "base"

    def __init__(self, site: Site, clock: ClockLike, options: TransportOptions | None = None) -> None:
        self.site = site
        self.clock = clock
        self.options = options or TransportOptions()
        self.inbox = Inbox()
        self.offers = Offers()
        self._closed = False
        self._ids = itertools.count(1)

    def deadline(self, deadline_ms: float | None) -> float:
        return self.clock.now_ms() + self.options.default_timeout_ms if deadline_ms is None else deadline_ms

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.name} transport at {self.site} is closed")

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None:
        """Offer blocks for peers to pull until ``withdraw``; the buffers must not change meanwhile."""
        self._check_open()
        self.offers.publish(request_id, blocks)

    def withdraw(self, request_id: RequestId) -> None:
        self.offers.withdraw(request_id)

    async def receive(self, request_id: RequestId, *, count: int = 1, deadline_ms: float | None = None) -> Delivery:
        """Wait until at least ``count`` pushed blocks of ``request_id`` are committed; take them all."""
        self._check_open()
        here = self.inbox.take_if(request_id, count)
        if here is not None:  # already here: no timer needed
            return here
        async with within(self.clock, self.deadline(deadline_ms), f"receive {request_id!r}"):
            return await self.inbox.wait(request_id, count)

    def discard(self, request_id: RequestId) -> None:
        """Drop the committed, unreceived blocks of ``request_id``."""
        self.inbox.discard(request_id)

    def _record(self, op: Op, request_id: RequestId, peer: Site, blocks: Sequence[Block], started_ms: float,
                wall_s: float) -> TransferRecord:
        real = sum([b.payload.nbytes for b in blocks])
        return TransferRecord.unshaped(request_id, op, self.name, peer, len(blocks), real, started_ms,
                                       self.clock.now_ms() - started_ms, wall_s * 1000.0)


@dataclass
class ByteBudget:
    """An async byte semaphore: bounded in-flight bytes with FIFO waiters (cancellation-safe).

    A request larger than the whole capacity is admitted when nothing else is in flight, so one
    oversized transfer cannot deadlock.
    """

    capacity: int
    used: int = 0
    _waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.used -= n  # granted while being cancelled: give it back
                self._wake()
            raise

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes now if that needs no wait (nobody queued, room left); False otherwise."""
        if not self._waiters and self._fits(n):
            self.used += n
            return True
        return False

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.capacity or self.used == 0

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.pop(0)
            if fut.done():
                continue
            self.used += n
            fut.set_result(None)
