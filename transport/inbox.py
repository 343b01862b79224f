"""Where blocks wait at an endpoint: the inbox of committed pushes and the offers peers may pull."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from transport.blocks import Block, BlockId, Delivery, Releasable, RequestId
from transport.errors import BlockNotFound, TransportClosed


class Inbox:
    """Committed pushes waiting for their receiver, by request id.

    ``receive`` waits until at least ``count`` distinct blocks of a request were committed, then hands
    all of them over in one delivery (first-arrival order). Deliveries are idempotent: a block that
    arrives again under the same request, id and layer range replaces the earlier copy, so a sender
    may retry a push whose outcome it does not know. ``discard`` drops a request's blocks (releasing
    their buffers); ``close`` drops everything and fails waiters with :class:`TransportClosed`.
    """

    def __init__(self) -> None:
        self._entries: dict[RequestId, dict[tuple[int, tuple[int, int]], Block]] = {}
        self._leases: dict[RequestId, dict[tuple[int, tuple[int, int]], Releasable]] = {}
        """The buffers holding some of ``_entries``' blocks (same keys); absent for requests without any."""
        self._changed: dict[RequestId, asyncio.Event] = {}
        self._closed = False

    def deliver(self, request_id: RequestId, blocks: Sequence[Block],
                leases: Sequence[Releasable | None] = ()) -> None:
        """Register ``blocks`` (with ``leases[i]`` holding ``blocks[i]``, if any) in one step."""
        if self._closed:
            for lease in leases:
                if lease is not None:
                    lease.release()
            return
        held = self._leases.get(request_id)
        if held is None and (not leases or all(lease is None for lease in leases)):  # nothing to release, now or later
            self.deliver_keyed(request_id, {(b.block_id, b.layers): b for b in blocks})
            return
        table = self._entries.get(request_id)
        if table is None:
            table = self._entries[request_id] = {}
        if held is None:
            held = self._leases[request_id] = {}
        for i, b in enumerate(blocks):
            key = (b.block_id, b.layers)
            old = held.pop(key, None)
            if old is not None:
                old.release()
            table[key] = b
            lease = leases[i] if i < len(leases) else None
            if lease is not None:
                held[key] = lease
        ev = self._changed.get(request_id)
        if ev is not None:
            ev.set()

    def deliver_keyed(self, request_id: RequestId, table: dict[tuple[int, tuple[int, int]], Block]) -> None:
        """``deliver`` of blocks without leases that the caller already keyed by ``(block_id, layers)`` (the
        inproc push, which builds the table in the pass that checks its blocks: one loop over them, not
        two). The inbox takes ``table`` over: the caller must not use it afterwards."""
        if self._closed:
            return
        old = self._entries.get(request_id)
        if old is None:  # the common case: the request's first delivery
            self._entries[request_id] = table
        elif request_id in self._leases:  # replacing blocks that hold buffers: release those
            self.deliver(request_id, list(table.values()))
            return
        else:
            old.update(table)
        ev = self._changed.get(request_id)
        if ev is not None:
            ev.set()

    def count(self, request_id: RequestId) -> int:
        table = self._entries.get(request_id)
        return 0 if table is None else len(table)

    def total_blocks(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def take_if(self, request_id: RequestId, count: int) -> Delivery | None:
        """Take the request's blocks when at least ``count`` (at least 1) are in; None otherwise (one call
        for what a receive that finds its blocks already here needs)."""
        table = self._entries.get(request_id)
        if table is None or len(table) < max(1, count):
            return None
        del self._entries[request_id]
        held = self._leases.pop(request_id, None)
        return Delivery(list(table.values()), () if held is None else list(held.values()))

    def take(self, request_id: RequestId) -> Delivery:
        table = self._entries.pop(request_id, None)
        if table is None:
            return Delivery([])
        held = self._leases.pop(request_id, None)
        return Delivery(list(table.values()), () if held is None else list(held.values()))

    async def wait(self, request_id: RequestId, count: int) -> Delivery:
        """Wait (no deadline here: the caller's scope has it) until ``count`` blocks are in, then take them."""
        while self.count(request_id) < max(1, count):
            if self._closed:
                raise TransportClosed("transport closed while waiting to receive")
            ev = self._changed.setdefault(request_id, asyncio.Event())
            ev.clear()
            try:
                await ev.wait()
            finally:
                if self._changed.get(request_id) is ev and not ev.is_set():
                    del self._changed[request_id]
        self._changed.pop(request_id, None)
        return self.take(request_id)

    def discard(self, request_id: RequestId) -> None:
        self.take(request_id).release()

    def close(self) -> None:
        self._closed = True
        for rid in list(self._entries):
            self.discard(rid)
        for ev in self._changed.values():
            ev.set()
        self._changed.clear()


class Offers:
    """Blocks published for peers to pull, by request id then block id (insertion ordered)."""

    def __init__(self) -> None:
        self._by_request: dict[RequestId, dict[BlockId, Block]] = {}

    def publish(self, request_id: RequestId, blocks: Iterable[Block]) -> None:
        table = self._by_request.setdefault(request_id, {})
        for b in blocks:
            table[b.block_id] = b

    def withdraw(self, request_id: RequestId) -> None:
        self._by_request.pop(request_id, None)

    def unpublish(self, request_id: RequestId, block_ids: Iterable[BlockId]) -> None:
        """Stop offering some blocks of ``request_id`` (a store evicting blocks it published)."""
        table = self._by_request.get(request_id)
        if table is not None:
            for b in block_ids:
                table.pop(b, None)

    def get(self, request_id: RequestId, block_ids: Sequence[BlockId]) -> list[Block]:
        table = self._by_request.get(request_id)
        if table is None:
            raise BlockNotFound(f"no blocks offered for request {request_id!r}")
        missing = [b for b in block_ids if b not in table]
        if missing:
            raise BlockNotFound(f"request {request_id!r} offers no block {missing[:8]}"
                                f"{' ...' if len(missing) > 8 else ''}")
        return [table[b] for b in block_ids]

    def clear(self) -> None:
        self._by_request.clear()
