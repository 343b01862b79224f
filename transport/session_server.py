"""The serving side of the framed session protocol (see :mod:`transport.session`): staged pushes,
their commits, and pull answers, per accepted connection."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

from transport.base import (
    Block,
    BlockId,
    BlockNotFound,
    FrameError,
    IntegrityError,
    PeerGone,
    Releasable,
    RequestId,
    TransferTimeout,
    TransportClosed,
    TransportError,
)
from transport.checksum import ChecksumName
from transport.coalesce import pack, runs, share, unpack
from transport.connection import MAX_STAGED_PER_CONNECTION, YIELD_BYTES, Connection
from transport.frame import (
    PUSH_DATA,
    Frame,
    FrameType,
    encode_ack,
    small_push_meta,
)
from transport.frame_fields import field_bool, field_int, field_int_list, field_layers, field_str
from transport.pool import Lease

if TYPE_CHECKING:
    from transport.session import FramedTransport


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
        self.leases: list[Releasable | None] = []
        """Aligned with ``blocks`` (None for an empty payload; a part of a shared lease for a table frame's block)."""
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
        t = f.meta["t"] if f.checked else field_int(f.meta, "t")
        ft = f.type
        if ft == PUSH_DATA:
            if ((f.checked or (f.meta.get("n") == 1 and f.meta.get("c") is True and "bt" not in f.meta))
                    and t not in self.staged):
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
        table = f.meta.get("bt")
        if table is not None:
            self._stage_table(st, f, table)
            return
        try:
            i, b, layers = field_int(f.meta, "i"), field_int(f.meta, "b"), field_layers(f.meta)
        except FrameError:
            f.release()
            raise
        if not self._in_order(st, f, i, f"block {b}"):
            return
        st.blocks.append(Block.decoded(b, f.payload.toreadonly(), layers, f.checksum, f.algo))
        st.leases.append(f.lease)

    @staticmethod
    def _in_order(st: Staged, f: Frame, i: int, what: str, bad: int | None = None) -> bool:
        """Whether frame ``f`` (``what``: its block or blocks, first at push index ``i``) extends ``st`` in order and
        intact (``bad``: a table's first block failing its own checksum); else the push's first fault is kept in
        ``st.bad`` and the frame released."""
        if st.bad is None and i != len(st.blocks):
            st.bad = FrameError(f"push block #{i} arrived out of order")
        elif st.bad is None and not f.intact:
            st.bad = IntegrityError(f"{what} arrived corrupted (payload checksum mismatch)")
        elif st.bad is None and bad is not None:
            st.bad = IntegrityError(f"block {bad} arrived corrupted (payload checksum mismatch)")
        if st.bad is not None:
            f.release()
            return False
        return True

    def _stage_table(self, st: Staged, f: Frame, table: Any) -> None:
        """Stage the blocks of a table frame (:mod:`transport.coalesce`), each holding a part of its one lease."""
        try:
            i = field_int(f.meta, "i")
            blocks, bad = unpack(table, f.payload)
        except FrameError:
            f.release()
            raise
        if not self._in_order(st, f, i, f"blocks {blocks[0].block_id}..{blocks[-1].block_id}", bad):
            return
        st.blocks.extend(blocks)
        st.leases.extend(share(f.lease, len(blocks)))

    def _push_one(self, t: int, f: Frame) -> None:
        """A whole one-block push that commits at once: what ``_stage`` + ``_end`` + ``_deliver`` do,
        without staging it (no ``Staged``, no table entries), for the same checks and the same answers."""
        meta = f.meta
        if f.checked:  # a small push frame: its decoder checked every field
            i, b, (start, stop), request_id, expires_at = 0, meta["b"], meta["l"], meta["r"], meta["x"]
            layers = (start, stop)
        else:
            try:
                i, b, layers = field_int(meta, "i"), field_int(meta, "b"), field_layers(meta)
                request_id, expires_at = field_str(meta, "r"), _expiry(meta)
            except FrameError:
                f.release()
                raise
        if i != 0:
            f.release()
            self._ack(t, FrameError(f"push block #{i} arrived out of order"))
            return
        self._commit_one(t, b, layers, request_id, expires_at, f.payload, f.lease, f.checksum, f.algo, f.intact)

    def on_small_push(self, t: int, b: int, layers: tuple[int, int], request_id: str, expires_at: float,
                      payload: memoryview, lease: Lease | None, checksum: int, algo: ChecksumName,
                      intact: bool) -> None:
        """A small push straight from the decoder (decoded, its fields type-checked, its payload verified:
        ``intact``), answered and delivered in the read callback that completed it."""
        if t in self.staged:  # a peer reusing the id of a push being staged: the general path says what is wrong
            meta = small_push_meta(t, b, *layers, expires_at, request_id)
            self.on_frame(Frame(PUSH_DATA, meta, payload, lease, checksum, algo, intact, True))
            return
        self._commit_one(t, b, layers, request_id, expires_at, payload, lease, checksum, algo, intact)

    def _commit_one(self, t: int, b: int, layers: tuple[int, int], request_id: str, expires_at: float | None,
                    payload: memoryview, lease: Lease | None, checksum: int, algo: ChecksumName,
                    intact: bool) -> None:
        """Check, answer and deliver one whole one-block push (a small push, or a one-block msgpack push)."""
        err: TransportError | None = None
        if not intact:
            err = IntegrityError(f"block {b} arrived corrupted (payload checksum mismatch)")
        elif self.owner.closed:
            err = TransportClosed("receiver closed")
        elif expires_at is not None and time.time() > expires_at:
            err = TransferTimeout("the commit reached the receiver after the sender's deadline")
        if err is not None:
            if lease is not None:
                lease.release()
            self._ack(t, err)
            return
        conn = self.conn
        if conn.alive:  # the answer (a compact ACK) leaves first: the delivery below is in the same step and
            conn.send_encoded(encode_ack(t))  # cannot fail; a gone peer needs no answer
        self.owner.inbox.deliver(RequestId(request_id),
                                 (Block.decoded(b, payload.toreadonly(), layers, checksum, algo),), (lease,))

    def on_ack(self, tid: int) -> None:
        raise FrameError("an initiator sent an ACK frame, which only servers send")

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
        if err is None and not staged:  # the common answer: a compact ACK (no msgpack, one prebuilt write)
            conn = self.conn
            if conn.alive:  # a gone peer needs no answer (what send's PeerGone would say)
                conn.send_encoded(encode_ack(t))
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
            for lo, hi in runs(blocks, self.owner.coalesce_bytes):  # small blocks: table frames (transport.coalesce)
                if unyielded >= YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)
                await conn.drain()
                if hi - lo == 1:
                    b = blocks[lo]
                    unyielded += b.nbytes
                    conn.send(FrameType.PULL_DATA, {"t": t, "i": lo, "b": b.block_id, "l": list(b.layers)},
                              block=b, algo=algo)
                else:
                    table, payload = pack(blocks[lo:hi], algo)
                    unyielded += len(payload)
                    conn.send(FrameType.PULL_DATA, {"t": t, "i": lo, "bt": table}, memoryview(payload), algo=algo)
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
