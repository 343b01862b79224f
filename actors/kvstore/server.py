"""The store's transport endpoint: puts arrive as pushes, gets are pulls, puts are copied to a replica.

Wire protocol (plain ``KVTransport`` calls, no new frame type):

- put: a client pushes blocks under request id ``PUT`` (block id = prefix hash, checksum supplied by the
  client and verified by the transport on arrival). One ingest task takes everything committed under
  ``PUT``, stores it (``store.BlockStore``: evicting by policy), publishes the newly held blocks under
  ``KV`` and unpublishes the evicted ones;
- get: a client pulls block ids (prefix hashes) under request id ``KV``. The transport's pull is already all
  or nothing (an id not offered fails the whole pull with ``BlockNotFound``) and carries each block's
  checksum, written at put time, end to end: a block corrupted at rest or on the wire fails with
  ``IntegrityError``. Nothing partial reaches a client;
- replication: with a replica address, every ingested batch is pushed to the replica's ``PUT`` in the
  background (best effort: failures are counted, the primary keeps serving).

Invariants: the ``KV`` offers are exactly the store's keys after each ingest step (published payloads are
the store's own immutable ``bytes``). Failure behaviour: a malformed or failed push never reaches the
ingest task (the transport drops it); the server never raises into the transport; ``close`` stops the
ingest and replication tasks and the endpoint, leaving no task behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

from actors.engine.kv_blocks import BlockHash
from actors.kvstore.store import CHECKSUM, BlockStore, Changes
from transport.base import (
    Address,
    Block,
    BlockId,
    KVTransport,
    Offers,
    RequestId,
    TransferTimeout,
    TransportClosed,
    TransportError,
)
from transport.checksum import checksum_of

PUT = RequestId("kvstore/put")
KV = RequestId("kvstore/kv")
REPLICA_QUEUE = 64
"""Batches waiting for the replica; beyond that the oldest is dropped (and counted)."""

log = logging.getLogger(__name__)


class Endpoint(KVTransport, Protocol):
    """A backend endpoint whose offers the server edits in place (every ``EndpointBase`` backend)."""

    offers: Offers


@dataclass
class ServerStats:
    puts: int = 0
    put_blocks: int = 0
    replicated_blocks: int = 0
    replication_failures: int = 0
    replication_dropped: int = 0


class StoreServer:
    """A ``BlockStore`` served on a transport endpoint (see the module docstring)."""

    def __init__(self, store: BlockStore, endpoint: Endpoint, *, replica: Address | None = None,
                 timeout_ms: float = 2_000.0) -> None:
        self.store = store
        self.endpoint = endpoint
        self.replica = replica
        self.timeout_ms = timeout_ms
        self.stats = ServerStats()
        self.address: Address | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._replica_q: asyncio.Queue[list[Block]] = asyncio.Queue(REPLICA_QUEUE)
        self.ingested = asyncio.Event()
        """Set after every ingest step (tests wait on it instead of sleeping)."""

    async def start(self) -> Address:
        self.address = await self.endpoint.serve()
        self._tasks.append(asyncio.create_task(self._ingest(), name="kvstore-ingest"))
        if self.replica is not None:
            self._tasks.append(asyncio.create_task(self._replicate(), name="kvstore-replicate"))
        return self.address

    def set_replica(self, replica: Address | None) -> None:
        """Copy puts to ``replica`` from now on (the launcher knows it only once both stores serve)."""
        self.replica = replica
        if replica is not None and not any(t.get_name() == "kvstore-replicate" for t in self._tasks):
            self._tasks.append(asyncio.create_task(self._replicate(), name="kvstore-replicate"))

    def changes_since(self, since: int) -> Changes:
        return self.store.changes_since(since)

    async def _ingest(self) -> None:
        clock = self.endpoint.clock
        while True:
            try:
                delivery = await self.endpoint.receive(PUT, count=1, deadline_ms=clock.now_ms() + 60_000.0)
            except TransferTimeout:
                continue
            except TransportClosed:
                return
            with delivery:
                self.ingest(delivery.blocks)

    def ingest(self, blocks: list[Block]) -> None:
        """Store one batch of pushed blocks and update the offers (synchronous: one step, no interleaving)."""
        keys = [BlockHash(int(b.block_id)) for b in blocks]
        payloads = [bytes(b.payload) for b in blocks]
        sums = [b.checksum if b.checksum_algo == CHECKSUM else None for b in blocks]
        before = {k for k in keys if k in self.store}
        result = self.store.put(list(zip(keys, payloads, strict=True)), sums)
        self.stats.puts += 1
        self.stats.put_blocks += len(blocks)
        if result.evicted:
            self.endpoint.offers.unpublish(KV, [BlockId(h) for h in result.evicted])
        fresh = [h for h in result.stored if h not in before]
        published = []
        for h, (payload, checksum) in zip(fresh, self.store.entries(fresh), strict=True):
            published.append(Block(BlockId(h), memoryview(payload).toreadonly(), (0, 1), checksum, CHECKSUM))
        self.endpoint.offers.publish(KV, published)
        if self.replica is not None and published:
            if self._replica_q.full():
                self._replica_q.get_nowait()
                self.stats.replication_dropped += 1
            self._replica_q.put_nowait(published)
        self.ingested.set()

    async def _replicate(self) -> None:
        clock = self.endpoint.clock
        while True:
            blocks = await self._replica_q.get()
            if self.replica is None:
                continue
            try:
                await self.endpoint.push(self.replica, PUT, blocks, deadline_ms=clock.now_ms() + self.timeout_ms)
                self.stats.replicated_blocks += len(blocks)
            except TransportError as e:
                self.stats.replication_failures += 1
                log.warning("kv store: replication to %s failed: %s", self.replica, e)

    def corrupt_for_test(self, key: BlockHash) -> None:
        """Bit rot at rest in a held block (its published payload too): the next get of it must fail."""
        payload, checksum = self.store.corrupt_for_test(key)
        self.endpoint.offers.publish(KV, [Block(BlockId(key), memoryview(payload).toreadonly(), (0, 1), checksum,
                                                CHECKSUM)])

    def verify_offers(self) -> bool:
        """The offers hold exactly the store's blocks with intact checksums (a test invariant)."""
        keys = self.store.keys()
        try:
            offered = self.endpoint.offers.get(KV, [BlockId(k) for k in keys]) if keys else []
        except TransportError:
            return False
        return all(checksum_of(CHECKSUM, b.payload) == b.checksum for b in offered)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        await self.endpoint.close()
