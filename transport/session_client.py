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
    TransferTimeout,
    TransportError,
    error_from_wire,
)
from transport.checksum import ChecksumChoice, checksum_of, pick
from transport.connection import YIELD_BYTES, Connection
from transport.endpoint import ByteBudget, Described
from transport.frame import (
    ACK,
    Frame,
    FrameType,
    encode_small_push,
    field_int,
    field_layers,
)
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
    """A small push's wait for its one answer: a single future, resolved by the answer frame, failed by a
    lost connection or, once the loop's clock passes ``due``, by its client's deadline sweep (the fast
    path's stand-in for ``Pending`` and ``within``)."""

    __slots__ = ("address", "due", "fut", "request_id")
    kind = "push"

    def __init__(self, loop: asyncio.AbstractEventLoop, due: float, request_id: RequestId, address: Address) -> None:
        self.fut: asyncio.Future[tuple[FrameType, dict[str, Any]]] = loop.create_future()
        self.due = due
        self.request_id = request_id
        self.address = address

    def resolve(self, ftype: FrameType, meta: dict[str, Any]) -> None:
        if not self.fut.done():
            self.fut.set_result((ftype, meta))

    def fail(self, err: TransportError) -> None:
        if not self.fut.done():
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

    async def push_small(self, request_id: RequestId, block: Block, expires_at: float, progress: Progress,
                         timeout_s: float, address: Address) -> float:
        """The small-push fast path: one small-push frame (fixed metadata, no msgpack; header, metadata and
        payload in one write), one future for the answer, a timer for the deadline; no task, no staging, no
        wait for budget or buffer space.

        The caller checked that the connection is ready and took ``block``'s bytes from the budget
        (:meth:`transport.endpoint.ByteBudget.try_acquire`); they go back here. Same frames, answers
        and failure behaviour as :meth:`push` without a gate: the receiver commits at once and
        acknowledges; a push given up before its answer sends ``CANCEL``.
        """
        conn = self.conn
        assert conn is not None
        n = block.payload.nbytes
        tid = next(self.ids)
        loop = asyncio.get_running_loop()
        due = loop.time() + timeout_s
        reply = self.pending[tid] = Reply(loop, due, request_id, address)
        self._watch(loop, due)
        answered = False
        t0 = time.perf_counter()
        try:
            payload = block.payload
            if block.checksum is not None:
                algo, checksum = block.checksum_algo, block.checksum
            else:
                algo = pick(self.owner.options.checksum, n)
                checksum = checksum_of(algo, payload) if n else 0
            try:
                head = encode_small_push(tid, block.block_id, block.layers, request_id, expires_at, payload, checksum,
                                         algo)
            except struct.error:  # an id or layer beyond the fixed layout: the same push as a msgpack frame
                conn.send(FrameType.PUSH_DATA, {"t": tid, "i": 0, "b": block.block_id, "l": list(block.layers),
                                                "r": request_id, "n": 1, "c": True, "x": expires_at},
                          block=block, algo=algo)
            else:
                conn.send_encoded(head, payload)
            progress.commit_sent = True
            ftype, meta = await reply.fut
            answered = progress.answered = True
            if meta.get("ok") is False:
                raise error_from_wire(str(meta.get("e", "transport")), f"peer {self.location}: {meta.get('m', '')}")
            if ftype != ACK:
                raise FrameError(f"expected ACK from {self.location}, got {ftype.name}")
            return time.perf_counter() - t0
        finally:
            if not answered:
                self._cancel(tid)
            del self.pending[tid]
            self.budget.release(n)

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
            last = len(blocks) - 1
            unyielded = 0
            sums = self._checksums_ahead(blocks, algo)
            for i, b in enumerate(blocks):
                if unyielded >= YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)  # let concurrent transfers interleave
                unyielded += b.nbytes
                if sums is not None and (ahead := sums[i]) is not None:
                    b = Block.decoded(b.block_id, b.payload, b.layers, await ahead, pick(algo, b.nbytes))
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

