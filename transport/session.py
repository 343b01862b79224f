"""The framed session protocol shared by the socket-like backends (TCP, UCX), above their connections.

A backend supplies a :class:`~transport.connection.Connection` (frames out in order, frames in through a
handler); :mod:`transport.session_client` (the initiator) and :mod:`transport.session_server` (the
serving side) supply both ends of the protocol over it, and this module the transport around them
(:class:`FramedTransport`).

Connections. An initiator keeps one connection per peer it calls (reused by every push and pull to
that peer, and reopened by the next call after it broke). Many transfers are multiplexed on it: each
has a transfer id, and frames of different transfers interleave at frame boundaries (a frame is
sent whole, never interleaved with another).

Push: ``PUSH_DATA`` per block, the last one also ending the push (``PUSH_END`` when there is no
block). The receiver stages the blocks and answers ``ACK`` when all arrived intact; with no gate it
commits at once (one round trip), otherwise the sender awaits the gate and sends ``COMMIT``, and the
receiver makes the blocks visible and acknowledges again. A sender that gives up (deadline,
cancellation, error) sends ``CANCEL`` and the receiver drops what it staged; a lost connection drops
everything staged on it. A commit carries the sender's deadline (``time.time()``; hosts are assumed
to keep their clocks in step to well under a deadline): a receiver that reads it later, because it
was backlogged, refuses it rather than deliver a push its sender already reported as failed.

Small pushes (one block of at most ``SMALL_PUSH`` bytes, no gate, on a connection ready to write) take
a fast path with the same guarantees, one synchronous call chain at each step of the round trip: the
caller's ``push`` checksums, encodes (one small-push frame, fixed-layout metadata, no msgpack; see
:mod:`transport.frame`) and writes it with its payload in one write (``Client.send_small``: no task, no
coroutine of its own, the connection's shared deadline sweep instead of a timer) and awaits one plain
future; the receiver's read callback decodes and verifies it, answers with a compact ACK and delivers
the block (``FrameDecoder.direct``, ``Server.on_small_push``); the sender's read callback completes the
future from the ACK (``Client.on_ack``), and ``push`` returns its record (``Client.finish_small``). Several
small blocks of at most ``SMALL_PUSH`` bytes in all (at most ``coalesce_bytes``: over ucx a larger table frame
would leave its control message for a rendezvous of its own, which measured slower than the general path's
inline frames) take the same path as one table frame (:mod:`transport.coalesce`) that ends and commits the
push; the receiver stages it as a msgpack frame and answers with the same compact ACK.

Pull: ``PULL``; the server answers ``PULL_HEAD`` (the size), a ``PULL_DATA`` per block (or table of small blocks) and
``PULL_END`` (or ``PULL_END`` with an error). A puller that gives up sends ``CANCEL``; the server stops.

Backpressure. Senders bound the bytes in flight per connection (``inflight_bytes``: ``max_inflight_bytes``,
less for ucx; released at the receiver's acknowledgement) and wait for the connection's send buffer to
drain between frames.
Receivers read into pooled buffers; when the pool is exhausted a connection stops reading until
buffers come back, which stalls its senders (their deadlines then fire).

Failure behaviour. Bytes that are not a valid frame raise ``FrameError`` and close only that
connection; the server keeps serving others. A payload failing its checksum fails its transfer with
``IntegrityError`` and keeps the connection. Every call ends by its deadline with a typed error, and
leaves no staged blocks, leased buffers or tasks behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from transport.base import (
    Address,
    Block,
    BlockId,
    ClockLike,
    Delivery,
    FrameError,
    Gate,
    RequestId,
    Site,
    SizeHook,
    TransferRecord,
    TransportClosed,
    TransportError,
    TransportOptions,
    TransportStats,
)
from transport.coalesce import COALESCE_BLOCK_MAX, COALESCE_MAX, COALESCE_ROWS
from transport.connection import MAX_STAGED_PER_CONNECTION, SMALL_PUSH, YIELD_BYTES, Connection, Handler
from transport.endpoint import Described, EndpointBase, within
from transport.frame import (
    Limits,
)
from transport.pool import BufferPool
from transport.session_client import Client, Pending, Progress
from transport.session_server import Server, Staged
from transport.verify import Verifier

__all__ = ["MAX_STAGED_PER_CONNECTION", "YIELD_BYTES", "Client", "Connection", "FramedTransport", "Handler",
           "Pending", "Progress", "Server", "Staged"]


def small_push_fits(blocks: Sequence[Block], most: int = SMALL_PUSH) -> bool:
    """Whether several blocks take the small-push path together, as one table frame: at most ``COALESCE_ROWS``
    blocks of at most ``COALESCE_BLOCK_MAX`` bytes each, ``most`` bytes in all (``SMALL_PUSH``, or less where a
    backend's table frames are smaller: ucx's stay inside their control message)."""
    if not 1 < len(blocks) <= COALESCE_ROWS:
        return False
    total = 0
    for b in blocks:
        n = b.payload.nbytes
        if n > COALESCE_BLOCK_MAX:
            return False
        total += n
    return total <= most


class FramedTransport(EndpointBase):
    """A transport over framed connections; a backend supplies ``serve`` and ``_open`` (see the module docstring)."""

    name = "framed"
    coalesce_bytes = COALESCE_MAX
    """The most payload bytes of consecutive small blocks sent as one table frame (:mod:`transport.coalesce`)."""

    def __init__(self, site: Site, clock: ClockLike, options: TransportOptions | None = None) -> None:
        super().__init__(site, clock, options)
        o = self.options
        self.pool = BufferPool(o.pool_bytes)
        self.limits = Limits(max_meta_bytes=o.max_meta_bytes, max_payload=o.max_frame_payload)
        self._clients: dict[str, Client] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._servers: set[Server] = set()
        self._conns: set[Connection] = set()
        self.frame_errors = 0
        self.connects = 0
        self.verifier = Verifier()
        """Computes and checks payload checksums of at least ``verify_thread_min_bytes`` off the loop's thread."""

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def inflight_bytes(self) -> int:
        """Bytes of pushes each connection keeps in flight (its senders' budget)."""
        return self.options.max_inflight_bytes

    def _count_frame_error(self, err: FrameError) -> None:
        self.frame_errors += 1

    def _track(self, conn: Connection) -> None:
        self._conns.add(conn)
        conn.lost.add_done_callback(lambda _f: self._conns.discard(conn))

    def _accepted(self, conn: Connection) -> Server:
        """The serving side of a connection a peer opened (backends call this from their accept path)."""
        srv = Server(self, conn)
        self._servers.add(srv)
        return srv

    async def _open(self, address: Address, client: Client) -> Connection:
        """Open a connection to ``address`` whose frames go to ``client``; raise ConnectError when it cannot."""
        raise NotImplementedError

    def _stop_serving(self) -> None:
        """Stop accepting connections (existing ones are aborted next)."""

    async def _serving_stopped(self) -> None:
        """Wait until the accepting side has shut down (after every connection was aborted)."""

    async def _client(self, address: Address) -> Client:
        location = address.location
        client = self._clients.get(location)
        if client is not None and client.alive:
            return client
        lock = self._connecting.setdefault(location, asyncio.Lock())
        async with lock:
            client = self._clients.get(location)
            if client is not None and client.alive:
                return client
            client = Client(self, location)
            conn = await self._open(address, client)
            if self._closed:
                conn.abort()
                raise TransportClosed("transport closed while connecting")
            client.conn = conn
            self._track(conn)
            self._clients[location] = client
            self.connects += 1
            return client

    async def push(self, address: Address, request_id: RequestId, blocks: Sequence[Block], *,
                   deadline_ms: float | None = None, gate: Gate | None = None) -> TransferRecord:
        self._check_open()
        if (gate is None and ((len(blocks) == 1 and blocks[0].payload.nbytes <= SMALL_PUSH)
                              or small_push_fits(blocks, min(SMALL_PUSH, self.coalesce_bytes)))
                and (client := self._clients.get(address.location)) is not None):
            reply = client.send_small(request_id, blocks, deadline_ms, address)  # written, or None: not now
            if reply is not None:
                try:
                    await reply.fut
                except asyncio.CancelledError:
                    client.abandon_small(reply)
                    raise
                except TransportError:
                    pass  # finish_small raises it
                return client.finish_small(reply)
        start = self.clock.now_ms()
        dl = start + self.options.default_timeout_ms if deadline_ms is None else deadline_ms
        expires_at = time.time() + self.clock.to_wall_s(dl - start)
        progress = Progress()
        try:
            async with within(self.clock, dl, Described(self.name, "push", request_id, "to", address)):
                client = await self._client(address)
                wall = await client.push(request_id, blocks, gate, expires_at, progress)
        except TransportError as e:
            e.maybe_delivered = progress.unknown
            raise
        return self._record("push", request_id, address.site, blocks, start, wall)

    async def pull(self, address: Address, request_id: RequestId, block_ids: Sequence[BlockId], *,
                   deadline_ms: float | None = None, on_size: SizeHook | None = None) -> Delivery:
        self._check_open()
        what = Described(self.name, "pull", request_id, "from", address)
        start = self.clock.now_ms()
        async with within(self.clock, self.deadline(deadline_ms), what):
            client = await self._client(address)
            blocks, leases, wall = await client.pull(request_id, block_ids, on_size)
        return Delivery(blocks, leases, self._record("pull", request_id, address.site, blocks, start, wall))

    def abort_connections(self, address: Address) -> int:
        """Reset this endpoint's connection to ``address`` (fault injection); returns how many were reset."""
        client = self._clients.get(address.location)
        if client is None or client.conn is None or not client.conn.alive:
            return 0
        client.conn.abort()
        return 1

    def stats(self) -> TransportStats:
        return TransportStats(
            connections=len(self._conns),
            pending=sum(len(c.pending) for c in self._clients.values()),
            staged=sum(len(s.staged) + len(s.committable) for s in self._servers),
            inbox_blocks=self.inbox.total_blocks(),
            pool_leases=self.pool.leases,
            pool_in_use_bytes=self.pool.in_use_bytes,
            tasks=sum(len(s.serving) for s in self._servers),
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_serving()
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.wait([c.lost for c in conns], timeout=5.0)
        tasks = [t for s in list(self._servers) for t in s.serving.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        await self._serving_stopped()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self.verifier.close()
        self.inbox.close()
        self.offers.clear()
