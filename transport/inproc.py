"""In-process backend: endpoints in one process hand each other views of the same memory.

Zero copy: a push or pull hands the receiver read-only views of the sender's buffers; nothing is copied
unless the receiver must own the bytes (``Delivery.detach()``). Endpoints find each other through an
:class:`InprocHub` (by default the process's hub, :data:`DEFAULT_HUB`).

Integrity: no byte moves, so there is nothing for a checksum to protect, except that a producer
(or the fault wrapper) may supply one: a supplied checksum is always verified before delivery, and
``TransportOptions.inproc_verify = "always"`` verifies every block.

Atomicity: a push registers its blocks in the receiver's inbox in one step after its gate opened; a
push that fails, times out or is cancelled earlier registered nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from transport.base import (
    Address,
    Block,
    BlockId,
    ClockLike,
    ConnectError,
    Delivery,
    Gate,
    IntegrityError,
    PeerGone,
    RequestId,
    Site,
    SizeHook,
    TransferRecord,
    TransferTimeout,
    TransportOptions,
    TransportStats,
)
from transport.endpoint import Described, EndpointBase, within


class InprocHub:
    """The endpoints of one process, by location (a registry: the only state it holds)."""

    def __init__(self) -> None:
        self._endpoints: dict[str, InprocTransport] = {}
        self._ids = itertools.count(1)

    def register(self, endpoint: InprocTransport) -> str:
        location = f"{endpoint.site.node}/{next(self._ids)}"
        self._endpoints[location] = endpoint
        return location

    def unregister(self, location: str) -> None:
        self._endpoints.pop(location, None)

    def lookup(self, address: Address) -> InprocTransport:
        if address.backend != "inproc":
            raise ConnectError(f"{address} is not an inproc address")
        ep = self._endpoints.get(address.location)
        if ep is None:
            raise ConnectError(f"no inproc endpoint serves {address} in this process")
        return ep


DEFAULT_HUB = InprocHub()


class InprocTransport(EndpointBase):
    """Same-process KV transport (see the module docstring)."""

    name = "inproc"

    def __init__(self, site: Site, clock: ClockLike, options: TransportOptions | None = None, *,
                 hub: InprocHub | None = None) -> None:
        super().__init__(site, clock, options)
        self.hub = hub or DEFAULT_HUB
        self._location: str | None = None
        self._pending = 0
        self._verify_supplied = self.options.inproc_verify == "supplied"

    async def serve(self) -> Address:
        self._check_open()
        if self._location is None:
            self._location = self.hub.register(self)
        return Address("inproc", self._location, self.site)

    def _peer(self, address: Address) -> InprocTransport:
        peer = self.hub.lookup(address)
        if peer._closed:
            raise PeerGone(f"inproc endpoint {address} closed")
        return peer

    def _handover(self, blocks: Sequence[Block], what: object) -> list[Block]:
        """Read-only views of ``blocks``, verified where a checksum was supplied (or always, if so configured)."""
        always = self.options.inproc_verify == "always"
        if not always and all(b.checksum is None and b.payload.readonly for b in blocks):
            return list(blocks)
        out = []
        for b in blocks:
            if always and b.checksum is None:
                b = b.with_checksum(self.options.checksum)
            if b.checksum is not None and not b.intact():
                raise IntegrityError(f"{what}: block {b.block_id} does not match its checksum")
            out.append(b if b.payload.readonly else
                       Block(b.block_id, b.payload.toreadonly(), b.layers, b.checksum, b.checksum_algo))
        return out

    async def push(self, address: Address, request_id: RequestId, blocks: Sequence[Block], *,
                   deadline_ms: float | None = None, gate: Gate | None = None) -> TransferRecord:
        self._check_open()
        clock = self.clock
        start, t0 = clock.now_ms(), time.perf_counter()
        if gate is None:  # nothing to wait for: one synchronous step, no timer
            if deadline_ms is not None and start > deadline_ms:  # (the default deadline is always ahead)
                raise TransferTimeout(f"{Described(self.name, 'push', request_id, 'to', address)}: called after its "
                                      "deadline")
            peer = self.hub._endpoints.get(address.location) if address.backend == "inproc" else None
            if peer is None or peer._closed:
                peer = self._peer(address)  # raises the error that says why
            if self._verify_supplied:  # the common case in one pass: views, no checksum, keyed as they are checked
                real = 0
                table: dict[tuple[int, tuple[int, int]], Block] = {}
                for b in blocks:
                    p = b.payload
                    if b.checksum is not None or not p.readonly:
                        break
                    real += p.nbytes
                    table[(b.block_id, b.layers)] = b
                else:
                    peer.inbox.deliver_keyed(request_id, table)
                    return TransferRecord.unshaped(request_id, "push", "inproc", address.site, len(blocks), real,
                                                   start, clock.now_ms() - start, (time.perf_counter() - t0) * 1000.0)
            peer.inbox.deliver(request_id, self._handover(blocks, Described(self.name, "push", request_id, "to",
                                                                            address)))
            return self._record("push", request_id, address.site, blocks, start, time.perf_counter() - t0)
        dl = self.deadline(deadline_ms)
        what = Described(self.name, "push", request_id, "to", address)
        self._pending += 1
        try:
            async with within(self.clock, dl, what):
                self._peer(address)  # fail fast when nobody serves there
                views = self._handover(blocks, what)
                wall = time.perf_counter() - t0
                await gate()
                self._peer(address).inbox.deliver(request_id, views)
        finally:
            self._pending -= 1
        return self._record("push", request_id, address.site, blocks, start, wall)

    async def pull(self, address: Address, request_id: RequestId, block_ids: Sequence[BlockId], *,
                   deadline_ms: float | None = None, on_size: SizeHook | None = None) -> Delivery:
        self._check_open()
        what = Described(self.name, "pull", request_id, "from", address)
        start, t0 = self.clock.now_ms(), time.perf_counter()
        if start > self.deadline(deadline_ms):
            raise TransferTimeout(f"{what}: called after its deadline")
        offered = self._peer(address).offers.get(request_id, block_ids)  # one synchronous step
        if on_size is not None:
            on_size(sum(b.nbytes for b in offered))
        views = self._handover(offered, what)
        rec = self._record("pull", request_id, address.site, views, start, time.perf_counter() - t0)
        return Delivery(views, (), rec)

    def stats(self) -> TransportStats:
        return TransportStats(pending=self._pending, inbox_blocks=self.inbox.total_blocks())

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._location is not None:
            self.hub.unregister(self._location)
        self.inbox.close()
        self.offers.clear()
