"""The framed session protocol shared by the socket-like backends (TCP, UCX), above their connections.

A backend supplies a :class:`Connection` (frames out in order, frames in through a handler); this
module supplies both ends of the protocol over it and the transport around them
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

Pull: ``PULL``; the server answers ``PULL_HEAD`` (the size), a ``PULL_DATA`` per block and
``PULL_END`` (or ``PULL_END`` with an error). A puller that gives up sends ``CANCEL``; the server stops.

Backpressure. Senders bound the bytes in flight per connection (``max_inflight_bytes``, released at
the receiver's acknowledgement) and wait for the connection's send buffer to drain between frames.
Receivers read into pooled buffers; when the pool is exhausted a connection stops reading until
buffers come back, which stalls its senders (their deadlines then fire).

Failure behaviour. Bytes that are not a valid frame raise ``FrameError`` and close only that
connection; the server keeps serving others. A payload failing its checksum fails its transfer with
``IntegrityError`` and keeps the connection. Every call ends by its deadline with a typed error, and
leaves no staged blocks, leased buffers or tasks behind.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol

from transport.base import (
    Address,
    Block,
    BlockId,
    BlockNotFound,
    ByteBudget,
    ClockLike,
    Delivery,
    EndpointBase,
    FrameError,
    Gate,
    IntegrityError,
    PeerGone,
    RequestId,
    Site,
    SizeHook,
    TransferRecord,
    TransferTimeout,
    TransportClosed,
    TransportError,
    TransportOptions,
    TransportStats,
    error_from_wire,
    within,
)
from transport.checksum import ChecksumChoice
from transport.frame import (
    Frame,
    FrameType,
    Limits,
    field_bool,
    field_int,
    field_int_list,
    field_layers,
    field_str,
)
from transport.pool import BufferPool, Lease

MAX_STAGED_PER_CONNECTION = 4096
YIELD_BYTES = 256 * 1024
"""A transfer yields to others on its connection after each this many payload bytes (not after every
frame: small frames queued in one loop iteration go out together, in one write or one UCX message)."""


class Handler(Protocol):
    """What a connection hands its frames and its end to."""

    def on_frame(self, frame: Frame) -> None: ...

    def on_lost(self, exc: BaseException | None) -> None: ...


class Connection(Protocol):
    """One connection of a backend: whole frames out in order, frames in to its handler.

    ``send`` queues or writes one frame without waiting (frames never interleave); ``drain`` waits
    while too much is queued; ``lost`` resolves once the connection is gone and its handler's
    ``on_lost`` ran.
    """

    lost: asyncio.Future[None]

    @property
    def alive(self) -> bool: ...

    def send(self, ftype: FrameType, meta: dict[str, Any], payload: memoryview | None = None, *,
             block: Block | None = None, algo: ChecksumChoice = "auto") -> None: ...

    async def drain(self) -> None: ...

    def abort(self) -> None:
        """Reset the connection now."""
        ...

    def close(self) -> None:
        """Close the connection, telling the peer if it could not otherwise know."""
        ...


class Pending:
    """A transfer the initiator waits on: control frames for it queue up here, in arrival order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.get_running_loop()
        self.queue: collections.deque[tuple[FrameType, dict[str, Any]]] = collections.deque()
        self.error: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.blocks: list[Block] = []
        self.leases: list[Lease] = []
        self.bad: TransportError | None = None
        self.expect: Sequence[int] = ()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def resolve(self, ftype: FrameType, meta: dict[str, Any]) -> None:
        self.queue.append((ftype, meta))
        self._wake()

    def fail(self, err: TransportError) -> None:
        if self.error is None:
            self.error = err
        self._wake()

    async def next(self) -> tuple[FrameType, dict[str, Any]]:
        while not self.queue:
            if self.error is not None:
                raise self.error
            self._waiter = self.loop.create_future()
            await self._waiter
        return self.queue.popleft()

    def release(self) -> None:
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()


class Progress:
    """How far a push got: whether a commit was sent, and whether the receiver answered it."""

    __slots__ = ("answered", "commit_sent")

    def __init__(self) -> None:
        self.commit_sent = False
        self.answered = False

    @property
    def unknown(self) -> bool:
        return self.commit_sent and not self.answered


class Client:
    """The initiator's connection to one peer and its transfers in flight."""

    def __init__(self, owner: FramedTransport, location: str) -> None:
        self.owner = owner
        self.location = location
        self.pending: dict[int, Pending] = {}
        self.budget = ByteBudget(owner.options.max_inflight_bytes)
        self.ids = itertools.count(1)
        self.conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self.conn is not None and self.conn.alive

    # handler interface
    def on_frame(self, f: Frame) -> None:
        t = field_int(f.meta, "t")
        p = self.pending.get(t)
        if f.type in (FrameType.ACK, FrameType.PULL_HEAD, FrameType.PULL_END):
            if p is not None:
                p.resolve(f.type, f.meta)
        elif f.type == FrameType.PULL_DATA:
            if p is None or p.kind != "pull" or not self._accept_block(p, f):
                f.release()
        else:
            f.release()
            raise FrameError(f"a server sent a {f.type.name} frame, which only initiators send")

    def _accept_block(self, p: Pending, f: Frame) -> bool:
        i, b, layers = field_int(f.meta, "i"), field_int(f.meta, "b"), field_layers(f.meta)
        if p.bad is not None:
            return False
        if i != len(p.blocks) or i >= len(p.expect) or b != p.expect[i]:
            p.bad = FrameError(f"pull answer block #{i} (id {b}) is not the one requested")
            return False
        if not f.intact:
            p.bad = IntegrityError(f"block {b} arrived corrupted (payload checksum mismatch)")
            return False
        assert f.lease is not None or f.payload.nbytes == 0
        p.blocks.append(Block(BlockId(b), f.payload.toreadonly(), layers, f.checksum, f.algo))
        if f.lease is not None:
            p.leases.append(f.lease)
        return True

    def on_lost(self, exc: BaseException | None) -> None:
        for p in self.pending.values():
            p.fail(PeerGone(f"connection to {self.location} lost" + (f" ({exc})" if exc else "")))

    async def _await(self, p: Pending, *expected: FrameType,
                     progress: Progress | None = None) -> tuple[FrameType, dict[str, Any]]:
        ftype, meta = await p.next()
        if progress is not None:
            progress.answered = True
        if meta.get("ok") is False:
            raise error_from_wire(str(meta.get("e", "transport")), f"peer {self.location}: {meta.get('m', '')}")
        if ftype not in expected:
            raise FrameError(f"expected {'/'.join(e.name for e in expected)} from {self.location}, got {ftype.name}")
        return ftype, meta

    def _cancel(self, tid: int) -> None:
        if self.conn is not None and self.conn.alive:
            with contextlib.suppress(TransportError):
                self.conn.send(FrameType.CANCEL, {"t": tid})

    async def push(self, request_id: RequestId, blocks: Sequence[Block], gate: Gate | None, expires_at: float,
                   progress: Progress) -> float:
        """Move ``blocks``; return the wall seconds until the receiver had them all, verified.

        ``expires_at`` (``time.time()`` seconds) travels with the commit: a receiver that reads the commit
        later refuses it. ``progress`` tells the caller whether a commit was sent and not answered.
        """
        assert self.conn is not None
        conn = self.conn
        tid = next(self.ids)
        p = self.pending[tid] = Pending("push")
        total = sum(b.nbytes for b in blocks)
        held = 0
        finished = False
        algo = self.owner.options.checksum
        t0 = time.perf_counter()  # real time includes waiting for the connection's in-flight budget
        try:
            held = min(total, self.budget.capacity)
            try:
                await self.budget.acquire(held)
            except BaseException:
                held = 0
                raise
            end = {"r": request_id, "n": len(blocks), "c": gate is None, "x": expires_at}
            last = len(blocks) - 1
            unyielded = 0
            for i, b in enumerate(blocks):
                if unyielded >= YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)  # let concurrent transfers interleave
                unyielded += b.nbytes
                await conn.drain()
                meta: dict[str, Any] = {"t": tid, "i": i, "b": b.block_id, "l": list(b.layers)}
                if i == last:
                    meta.update(end)  # the last block ends the push: one frame fewer per push
                conn.send(FrameType.PUSH_DATA, meta, block=b, algo=algo)
            if not blocks:
                await conn.drain()
                conn.send(FrameType.PUSH_END, {"t": tid, **end})
            progress.commit_sent = gate is None
            await self._await(p, FrameType.ACK, progress=progress)
            wall = time.perf_counter() - t0
            self.budget.release(held)
            held = 0
            if gate is not None:
                await gate()
                conn.send(FrameType.COMMIT, {"t": tid, "x": expires_at})
                progress.commit_sent, progress.answered = True, False
                await self._await(p, FrameType.ACK, progress=progress)
            finished = True
            return wall
        finally:
            if not finished:
                self._cancel(tid)
            self.pending.pop(tid, None)
            if held:
                self.budget.release(held)

    async def pull(self, request_id: RequestId, block_ids: Sequence[BlockId],
                   on_size: SizeHook | None) -> tuple[list[Block], list[Lease], float]:
        assert self.conn is not None
        conn = self.conn
        tid = next(self.ids)
        p = self.pending[tid] = Pending("pull")
        p.expect = list(block_ids)
        finished = False
        try:
            t0 = time.perf_counter()
            await conn.drain()
            conn.send(FrameType.PULL, {"t": tid, "r": request_id, "ids": list(block_ids)})
            _, head = await self._await(p, FrameType.PULL_HEAD)
            if on_size is not None:
                on_size(field_int(head, "bytes"))
            await self._await(p, FrameType.PULL_END)
            finished = True
            if p.bad is not None:
                raise p.bad
            if len(p.blocks) != len(p.expect):
                raise FrameError(f"pull answer has {len(p.blocks)} blocks, {len(p.expect)} were requested")
            leases, p.leases = p.leases, []
            return p.blocks, leases, time.perf_counter() - t0
        finally:
            if not finished:
                self._cancel(tid)
            p.release()
            self.pending.pop(tid, None)


# -- serving side ---------------------------------------------------------------------------------
def _expiry(meta: dict[str, Any]) -> float | None:
    """The sender's deadline carried by a commit (``time.time()`` seconds), if any."""
    x = meta.get("x")
    if x is None:
        return None
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise FrameError("frame field 'x' must be a number (the sender's deadline)")
    return float(x)


class Staged:
    __slots__ = ("bad", "blocks", "leases", "request_id")

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.leases: list[Lease | None] = []
        """Aligned with ``blocks`` (None for an empty payload)."""
        self.bad: TransportError | None = None
        self.request_id: RequestId = RequestId("")

    def release(self) -> None:
        leases, self.leases = self.leases, []
        for lease in leases:
            if lease is not None:
                lease.release()


class Server:
    """The serving side of one accepted connection: staged pushes and pull answers in progress."""

    def __init__(self, owner: FramedTransport, conn: Connection) -> None:
        self.owner = owner
        self.conn = conn
        self.staged: dict[int, Staged] = {}
        self.committable: dict[int, Staged] = {}
        self.serving: dict[int, asyncio.Task[None]] = {}

    def on_frame(self, f: Frame) -> None:
        t = field_int(f.meta, "t")
        ft = f.type
        if ft == FrameType.PUSH_DATA:
            if f.meta.get("n") == 1 and f.meta.get("c") is True and t not in self.staged:
                self._push_one(t, f)  # the small-push fast path: one block, committed at once
                return
            self._stage(t, f)
            if "n" in f.meta:
                self._end(t, field_str(f.meta, "r"), field_int(f.meta, "n"), field_bool(f.meta, "c"),
                          _expiry(f.meta))
        elif ft == FrameType.PUSH_END:
            self._end(t, field_str(f.meta, "r"), field_int(f.meta, "n"), field_bool(f.meta, "c"), _expiry(f.meta))
        elif ft == FrameType.COMMIT:
            st = self.committable.pop(t, None)
            if st is None:
                self._ack(t, BlockNotFound(f"transfer {t} is not staged (cancelled, failed or already committed)"))
            else:
                self._deliver(t, st, _expiry(f.meta))
        elif ft == FrameType.CANCEL:
            if f.meta.get("bye") is True:  # the initiator is closing this connection
                self.conn.abort()
                return
            for table in (self.staged, self.committable):
                dropped = table.pop(t, None)
                if dropped is not None:
                    dropped.release()
            task = self.serving.pop(t, None)
            if task is not None:
                task.cancel()
        elif ft == FrameType.PULL:
            r, ids = field_str(f.meta, "r"), field_int_list(f.meta, "ids")
            if t in self.serving:
                raise FrameError(f"transfer id {t} is already being served")
            task = asyncio.get_running_loop().create_task(self._serve_pull(t, RequestId(r), ids))
            self.serving[t] = task
            task.add_done_callback(functools.partial(self._served, t))
        else:
            f.release()
            raise FrameError(f"an initiator sent a {ft.name} frame, which only servers send")

    def _served(self, t: int, task: asyncio.Task[None]) -> None:
        if self.serving.get(t) is task:
            del self.serving[t]

    def _stage(self, t: int, f: Frame) -> None:
        st = self.staged.get(t)
        if st is None:
            if len(self.staged) + len(self.committable) >= MAX_STAGED_PER_CONNECTION:
                f.release()
                raise FrameError(f"more than {MAX_STAGED_PER_CONNECTION} pushes staged on one connection")
            st = self.staged[t] = Staged()
        try:
            i, b, layers = field_int(f.meta, "i"), field_int(f.meta, "b"), field_layers(f.meta)
        except FrameError:
            f.release()
            raise
        if st.bad is None and i != len(st.blocks):
            st.bad = FrameError(f"push block #{i} arrived out of order")
        elif st.bad is None and not f.intact:
            st.bad = IntegrityError(f"block {b} arrived corrupted (payload checksum mismatch)")
        if st.bad is not None:
            f.release()
            return
        st.blocks.append(Block(BlockId(b), f.payload.toreadonly(), layers, f.checksum, f.algo))
        st.leases.append(f.lease)

    def _push_one(self, t: int, f: Frame) -> None:
        """A whole one-block push that commits at once: what ``_stage`` + ``_end`` + ``_deliver`` do,
        without staging it (no ``Staged``, no table entries), for the same checks and the same answers."""
        meta = f.meta
        try:
            i, b, layers = field_int(meta, "i"), field_int(meta, "b"), field_layers(meta)
            request_id, expires_at = field_str(meta, "r"), _expiry(meta)
        except FrameError:
            f.release()
            raise
        err: TransportError | None = None
        if i != 0:
            err = FrameError(f"push block #{i} arrived out of order")
        elif not f.intact:
            err = IntegrityError(f"block {b} arrived corrupted (payload checksum mismatch)")
        elif self.owner.closed:
            err = TransportClosed("receiver closed")
        elif expires_at is not None and time.time() > expires_at:
            err = TransferTimeout("the commit reached the receiver after the sender's deadline")
        if err is not None:
            f.release()
            self._ack(t, err)
            return
        self.owner.inbox.deliver(RequestId(request_id),
                                 (Block(BlockId(b), f.payload.toreadonly(), layers, f.checksum, f.algo),),
                                 (f.lease,))
        self._ack(t, None)

    def _end(self, t: int, request_id: str, n: int, commit: bool, expires_at: float | None) -> None:
        st = self.staged.pop(t, None) or Staged()
        st.request_id = RequestId(request_id)
        if st.bad is None and len(st.blocks) != n:
            st.bad = IntegrityError(f"push announced {n} blocks, {len(st.blocks)} arrived")
        if st.bad is not None:
            st.release()
            self._ack(t, st.bad)
        elif commit:
            self._deliver(t, st, expires_at)
        else:
            self.committable[t] = st
            self._ack(t, None, staged=True)

    def _deliver(self, t: int, st: Staged, expires_at: float | None) -> None:
        if self.owner.closed:
            st.release()
            self._ack(t, TransportClosed("receiver closed"))
            return
        if expires_at is not None and time.time() > expires_at:
            st.release()
            self._ack(t, TransferTimeout("the commit reached the receiver after the sender's deadline"))
            return
        self.owner.inbox.deliver(st.request_id, st.blocks, st.leases)
        st.leases = []
        self._ack(t, None)

    def _ack(self, t: int, err: TransportError | None, staged: bool = False) -> None:
        if err is None and not staged:
            with contextlib.suppress(PeerGone):
                self.conn.send(FrameType.ACK, {"t": t, "ok": True})
            return
        meta: dict[str, Any] = {"t": t, "ok": err is None}
        if staged:
            meta["s"] = True
        if err is not None:
            meta["e"], meta["m"] = err.code, str(err)
        with contextlib.suppress(PeerGone):
            self.conn.send(FrameType.ACK, meta)

    async def _serve_pull(self, t: int, request_id: RequestId, ids: list[int]) -> None:
        conn = self.conn
        try:
            try:
                blocks = self.owner.offers.get(request_id, [BlockId(i) for i in ids])
            except BlockNotFound as e:
                conn.send(FrameType.PULL_END, {"t": t, "ok": False, "e": e.code, "m": str(e)})
                return
            conn.send(FrameType.PULL_HEAD, {"t": t, "n": len(blocks), "bytes": sum(b.nbytes for b in blocks)})
            algo = self.owner.options.checksum
            unyielded = 0
            for i, b in enumerate(blocks):
                if unyielded >= YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)
                unyielded += b.nbytes
                await conn.drain()
                conn.send(FrameType.PULL_DATA, {"t": t, "i": i, "b": b.block_id, "l": list(b.layers)},
                          block=b, algo=algo)
            await conn.drain()
            conn.send(FrameType.PULL_END, {"t": t, "ok": True, "n": len(blocks)})
        except PeerGone:
            return

    def on_lost(self, exc: BaseException | None) -> None:
        for table in (self.staged, self.committable):
            for st in table.values():
                st.release()
            table.clear()
        for task in self.serving.values():
            task.cancel()
        self.owner._servers.discard(self)


class FramedTransport(EndpointBase):
    """A transport over framed connections; a backend supplies ``serve`` and ``_open`` (see the module docstring)."""

    name = "framed"

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

    @property
    def closed(self) -> bool:
        return self._closed

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
        what = f"{self.name} push {request_id!r} to {address}"
        start = self.clock.now_ms()
        dl = self.deadline(deadline_ms)
        expires_at = time.time() + self.clock.to_wall_s(dl - start)
        progress = Progress()
        try:
            async with within(self.clock, dl, what):
                client = await self._client(address)
                wall = await client.push(request_id, blocks, gate, expires_at, progress)
        except TransportError as e:
            e.maybe_delivered = progress.unknown
            raise
        return self._record("push", request_id, address.site, blocks, start, wall)

    async def pull(self, address: Address, request_id: RequestId, block_ids: Sequence[BlockId], *,
                   deadline_ms: float | None = None, on_size: SizeHook | None = None) -> Delivery:
        self._check_open()
        what = f"{self.name} pull {request_id!r} from {address}"
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
        self._clients.clear()
        self.inbox.close()
        self.offers.clear()
