"""The initiator's side of the framed session protocol (see :mod:`transport.session`): pushes and pulls
multiplexed on one connection per peer, each waiting on its own control frames."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xxhash import xxh3_64_intdigest

from transport.base import (
    Address,
    Block,
    BlockId,
    FrameError,
    Gate,
    IntegrityError,
    PeerGone,
    RequestId,
    SizeHook,
    TransferRecord,
    TransferTimeout,
    TransportError,
    error_from_wire,
)
from transport.checksum import ChecksumChoice, ChecksumName, checksum_of, pick
from transport.coalesce import pack, runs, unpack
from transport.connection import YIELD_BYTES, Connection
from transport.endpoint import ByteBudget, Described
from transport.frame import (
    ACK,
    Frame,
    FrameType,
    encode_small_push,
)
from transport.frame_fields import field_int, field_layers
from transport.pool import Lease

if TYPE_CHECKING:
    from transport.session import FramedTransport


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


class Reply:
    """A small push in flight (see :meth:`Client.send_small`): its one future and what its record needs. The
    future is resolved by the answer (None for a compact ACK, else the answer frame's type and map), failed by a
    lost connection or, once the loop's clock passes ``due``, by its client's deadline sweep (the fast path's
    stand-in for ``Pending`` and ``within``); a failure after the write says ``maybe_delivered``."""

    __slots__ = ("address", "count", "due", "fut", "nbytes", "request_id", "started_ms", "t0", "tid")
    kind = "push"

    def __init__(self, fut: asyncio.Future[tuple[FrameType, dict[str, Any]] | None], due: float, tid: int,
                 request_id: RequestId, address: Address, nbytes: int, started_ms: float, t0: float,
                 count: int = 1) -> None:
        self.count = count
        """Blocks in the push."""
        self.fut = fut
        self.due = due
        self.tid = tid
        self.request_id = request_id
        self.address = address
        self.nbytes = nbytes
        self.started_ms = started_ms
        self.t0 = t0

    def resolve(self, ftype: FrameType, meta: dict[str, Any]) -> None:
        if not self.fut.done():
            self.fut.set_result((ftype, meta))

    def fail(self, err: TransportError) -> None:
        if not self.fut.done():
            err.maybe_delivered = True  # the push was written whole: the receiver may have committed it
            self.fut.set_exception(err)


class Progress:
    """How far a push got: whether a commit was sent, and whether the receiver answered it."""

    __slots__ = ("answered", "commit_sent")

    def __init__(self) -> None:
        self.commit_sent = False
        self.answered = False

    @property
    def unknown(self) -> bool:
        return self.commit_sent and not self.answered


_ANSWERS = frozenset((FrameType.ACK, FrameType.PULL_HEAD, FrameType.PULL_END))
"""The control frames a transfer waits on (a set built once: not three enum lookups per answer)."""

TIMER_SLACK = 1e-3
"""Event-loop timers fire to within about a millisecond (uvloop's resolution), possibly early."""


class Client:
    """The initiator's connection to one peer and its transfers in flight.

    Small pushes' deadlines share one timer (a timer per push costs a uvloop call_later and cancel,
    about 2 us, per push): it is set for the earliest deadline among them, and when it fires it fails
    every small push past its deadline and sets itself for the next one. A push that ends first just
    leaves ``pending``; the timer then finds nothing to fail.
    """

    def __init__(self, owner: FramedTransport, location: str) -> None:
        self.owner = owner
        self.location = location
        self.pending: dict[int, Pending | Reply] = {}
        self.budget = ByteBudget(owner.inflight_bytes)
        self.ids = itertools.count(1)
        self.conn: Connection | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = math.inf

    def _watch(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        """Make sure the deadline sweep runs by ``due`` (loop time)."""
        if due < self._sweep_at:
            if self._sweep is not None:
                self._sweep.cancel()
            self._sweep_at = due
            self._sweep = loop.call_at(due, self._expire_due, loop)

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """The deadline sweep: fail the small pushes past their deadline, then wait for the next deadline."""
        self._sweep, self._sweep_at = None, math.inf
        now = loop.time() + TIMER_SLACK  # a timer may fire up to its resolution early: that counts as due
        nxt = math.inf
        for p in list(self.pending.values()):
            if isinstance(p, Reply) and not p.fut.done():
                if p.due <= now:
                    what = Described(self.owner.name, "push", p.request_id, "to", p.address)
                    p.fail(TransferTimeout(f"{what}: missed its deadline"))
                else:
                    nxt = min(nxt, p.due)
        if nxt < math.inf:
            self._watch(loop, nxt)

    def close(self) -> None:
        """Stop the deadline sweep (the transport is closing; its connections fail what is pending)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep, self._sweep_at = None, math.inf

    @property
    def alive(self) -> bool:
        return self.conn is not None and self.conn.alive

    # handler interface
    def on_ack(self, tid: int) -> None:
        """A compact ACK (success) for transfer ``tid``, straight from the decoder."""
        p = self.pending.get(tid)
        if type(p) is Reply:
            if not p.fut.done():
                p.fut.set_result(None)
        elif p is not None:
            p.resolve(ACK, {"t": tid, "ok": True})

    def on_small_push(self, t: int, b: int, layers: tuple[int, int], request_id: str, expires_at: float,
                      payload: memoryview, lease: Lease | None, checksum: int, algo: ChecksumName,
                      intact: bool) -> None:
        if lease is not None:
            lease.release()
        raise FrameError("a server sent a PUSH_DATA frame, which only initiators send")

    def on_frame(self, f: Frame) -> None:
        t = f.meta["t"] if f.checked else field_int(f.meta, "t")
        p = self.pending.get(t)
        if f.type in _ANSWERS:
            if p is not None:
                p.resolve(f.type, f.meta)
        elif f.type == FrameType.PULL_DATA:
            if not isinstance(p, Pending) or p.kind != "pull" or not self._accept_block(p, f):
                f.release()
        else:
            f.release()
            raise FrameError(f"a server sent a {f.type.name} frame, which only initiators send")

    def _accept_block(self, p: Pending, f: Frame) -> bool:
        if "bt" in f.meta:
            return self._accept_table(p, f)
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
        p.blocks.append(Block.decoded(b, f.payload.toreadonly(), layers, f.checksum, f.algo))
        if f.lease is not None:
            p.leases.append(f.lease)
        return True

    def _accept_table(self, p: Pending, f: Frame) -> bool:
        """Take the blocks of a table frame of a pull answer (:mod:`transport.coalesce`); False when the frame
        is not kept (the caller releases it)."""
        try:
            i = field_int(f.meta, "i")
            blocks, bad = unpack(f.meta["bt"], f.payload)
        except FrameError:
            f.release()
            raise
        if p.bad is not None:
            return False
        ids = [b.block_id for b in blocks]
        if i != len(p.blocks) or list(p.expect[i:i + len(ids)]) != ids:
            p.bad = FrameError(f"pull answer blocks #{i}.. (ids {ids[0]}..) are not the ones requested")
            return False
        if not f.intact or bad is not None:
            which = f"block {bad}" if bad is not None else f"blocks {ids[0]}..{ids[-1]}"
            p.bad = IntegrityError(f"{which} arrived corrupted (payload checksum mismatch)")
            return False
        p.blocks.extend(blocks)
        if f.lease is not None:  # one lease for the whole pull answer frame: its blocks are delivered together
            p.leases.append(f.lease)
        return True

    def on_lost(self, exc: BaseException | None) -> None:
        self.close()
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

    def send_small(self, request_id: RequestId, blocks: Sequence[Block], deadline_ms: float | None,
                   address: Address) -> Reply | None:
        """Start a small push (no gate; one block of at most ``SMALL_PUSH`` bytes, or several small blocks of at
        most ``SMALL_PUSH`` bytes together: :func:`transport.session.small_push_fits`) in one synchronous step, or
        return None (nothing done) when the connection or the budget would make it wait: the caller then takes
        the general path. Several blocks go as one table frame (:mod:`transport.coalesce`) that ends and
        commits the push, answered like a one-block push.

        One call chain from the caller to the socket's write: the deadline, one future (no task, no coroutine
        of its own), the payload's checksum, header, fixed metadata and payload encoded as one small-push
        frame and written at once. The receiver answers from its read callback; the answer completes the
        future (:meth:`on_ack`), and :meth:`finish_small` (or :meth:`abandon_small`) ends the push. Same
        frames, answers and failure behaviour as :meth:`push` without a gate; a push given up before its
        answer sends ``CANCEL``. Its deadline is the client's shared sweep, not a timer of its own.

        The frame is written before the push is registered (its future, ``pending``, the sweep): its answer is
        read by a callback of this same loop, which cannot run before this call returns, and a connection lost
        while writing is reported by a callback too (asyncio and uvloop both defer ``connection_lost``). So
        the receiver starts on the push while this side does that bookkeeping, not after it.
        """
        conn = self.conn
        block = blocks[0]
        count = len(blocks)
        n = block.payload.nbytes if count == 1 else sum(b.payload.nbytes for b in blocks)
        if conn is None or not conn.ready or not self.budget.try_acquire(n):
            return None
        t0 = time.perf_counter()
        owner = self.owner
        clock = owner.clock
        start = clock.now_ms()
        timeout_s = max(0.0, clock.to_wall_s(owner.options.default_timeout_ms if deadline_ms is None
                                             else deadline_ms - start))
        tid = next(self.ids)
        try:
            if count > 1:  # several small blocks: one table frame that ends and commits the push
                table, payload = pack(blocks, owner.options.checksum)
                conn.send(FrameType.PUSH_DATA, {"t": tid, "i": 0, "bt": table, "r": request_id, "n": count, "c": True,
                                                "x": time.time() + timeout_s}, memoryview(payload),
                          algo=owner.options.checksum)
            else:
                self._send_one(conn, tid, request_id, block, n, time.time() + timeout_s)
        except BaseException:  # nothing was written: no CANCEL, nothing maybe delivered
            self.budget.release(n)
            raise
        loop = asyncio.get_running_loop()  # written: now what its answer (or its deadline) will need
        due = loop.time() + timeout_s
        reply = self.pending[tid] = Reply(loop.create_future(), due, tid, request_id, address, n, start, t0, count)
        if due < self._sweep_at:
            self._watch(loop, due)
        return reply

    def _send_one(self, conn: Connection, tid: int, request_id: RequestId, block: Block, n: int,
                  expires_at: float) -> None:
        """Write a one-block small push: checksum, header and fixed metadata, then its payload (see ``send_small``)."""
        payload = block.payload
        if block.checksum is not None:
            algo, checksum = block.checksum_algo, block.checksum
        else:
            algo = pick(self.owner.options.checksum, n)
            checksum = (xxh3_64_intdigest(payload) if algo == "xxh3" else checksum_of(algo, payload)) if n else 0
        try:
            head = encode_small_push(tid, block.block_id, block.layers, request_id, expires_at, payload, checksum, algo)
        except struct.error:  # an id or layer beyond the fixed layout: the same push as a msgpack frame
            conn.send(FrameType.PUSH_DATA, {"t": tid, "i": 0, "b": block.block_id, "l": list(block.layers),
                                            "r": request_id, "n": 1, "c": True, "x": expires_at},
                      block=block, algo=algo)
        else:
            conn.send_encoded(head, payload)

    def finish_small(self, reply: Reply) -> TransferRecord:
        """End a small push whose future completed: its record, or the error its answer reported."""
        del self.pending[reply.tid]
        self.budget.release(reply.nbytes)
        try:
            answer = reply.fut.result()
        except TransportError:  # a lost connection or a missed deadline (maybe delivered): tell the receiver
            self._cancel(reply.tid)
            raise
        if answer is not None:
            ftype, meta = answer
            if meta.get("ok") is False:
                raise error_from_wire(str(meta.get("e", "transport")), f"peer {self.location}: {meta.get('m', '')}")
            if ftype != ACK:
                raise FrameError(f"expected ACK from {self.location}, got {ftype.name}")
        owner = self.owner
        wall_ms = (time.perf_counter() - reply.t0) * 1000.0
        return TransferRecord.unshaped(reply.request_id, "push", owner.name, reply.address.site, reply.count,
                                       reply.nbytes, reply.started_ms, owner.clock.now_ms() - reply.started_ms, wall_ms)

    def abandon_small(self, reply: Reply) -> None:
        """A small push whose caller gave up (cancelled) before its answer: CANCEL it, return its budget."""
        if self.pending.pop(reply.tid, None) is not None:
            self.budget.release(reply.nbytes)
            self._cancel(reply.tid)

    async def push(self, request_id: RequestId, blocks: Sequence[Block], gate: Gate | None, expires_at: float,
                   progress: Progress) -> float:
        """Move ``blocks``; return the wall seconds until the receiver had them all, verified.

        ``expires_at`` (``time.time()`` seconds) travels with the commit: a receiver that reads the commit
        later refuses it. ``progress`` tells the caller whether a commit was sent and not answered.
        """
        assert self.conn is not None
        conn = self.conn
        tid = next(self.ids)
        p = Pending("push")
        self.pending[tid] = p
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
            count = len(blocks)
            unyielded = 0
            sums = self._checksums_ahead(blocks, algo)
            for lo, hi in runs(blocks, self.owner.coalesce_bytes):
                if unyielded >= YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)  # let concurrent transfers interleave
                meta: dict[str, Any]
                if hi - lo == 1:
                    b = blocks[lo]
                    unyielded += b.nbytes
                    if sums is not None and (ahead := sums[lo]) is not None:
                        b = Block.decoded(b.block_id, b.payload, b.layers, await ahead, pick(algo, b.nbytes))
                    await conn.drain()
                    meta = {"t": tid, "i": lo, "b": b.block_id, "l": list(b.layers)}
                    if hi == count:
                        meta.update(end)  # the last frame ends the push: one frame fewer per push
                    conn.send(FrameType.PUSH_DATA, meta, block=b, algo=algo)
                else:  # consecutive small blocks: one table frame (transport.coalesce)
                    table, payload = pack(blocks[lo:hi], algo)
                    unyielded += len(payload)
                    await conn.drain()
                    meta = {"t": tid, "i": lo, "bt": table}
                    if hi == count:
                        meta.update(end)
                    conn.send(FrameType.PUSH_DATA, meta, memoryview(payload), algo=algo)
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

    def _checksums_ahead(self, blocks: Sequence[Block],
                         algo: ChecksumChoice) -> list[asyncio.Future[int] | None] | None:
        """The checksums a push's large blocks lack, started on the verifier thread so each is computed while
        the loop writes the blocks before it (None when no block needs one there)."""
        least = self.owner.options.verify_thread_min_bytes
        if not least or all(b.checksum is not None or b.nbytes < least for b in blocks):
            return None
        verifier = self.owner.verifier
        return [verifier.checksum(pick(algo, b.nbytes), b.payload) if b.checksum is None and b.nbytes >= least
                else None for b in blocks]

    async def pull(self, request_id: RequestId, block_ids: Sequence[BlockId],
                   on_size: SizeHook | None) -> tuple[list[Block], list[Lease], float]:
        assert self.conn is not None
        conn = self.conn
        tid = next(self.ids)
        p = Pending("pull")
        self.pending[tid] = p
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

