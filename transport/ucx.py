"""UCX backend (``ucxx``, the optional ``ucx`` extra): the session protocol of :mod:`transport.session`
over UCX tagged messages, in host memory, at close to the speed ``ucx_perftest`` reaches on the host.

Why it is built this way (each point was measured; see ``bench/transport.py``):

- **Its own worker, progressed on the event loop** (:class:`~transport.ucx_worker.UcxWorker`, with
  UCX's defaults rather than ucxx's GPU-oriented ones): see :mod:`transport.ucx_worker`.
- **Endpoints by worker address, without error handling on one host.** UCX's peer-failure mode
  excludes the shared-memory transports, so an endpoint opened with it runs over TCP loopback even
  between two processes of one host. A peer on this host (its address carries the same host
  identity) is reached by its worker address (which travels inside its
  :class:`~transport.base.Address`, through Ray) with error handling off: UCX then picks shared memory
  (``cma`` rendezvous for large messages). A peer on another host is reached by worker address with
  error handling on (TCP or the fabric), or through the listener (``host:port``) when
  ``TransportOptions.ucx_same_host`` is ``"listener"``.
- **Frames batched into control messages, large payloads beside them, many in flight.** Every UCX
  request costs Python and C++ work (about 20 us here), so per-message work, not bytes, bounded small
  transfers. Frames queued in one loop iteration travel as one control message (a 4-byte length, then
  each frame's header and metadata, with its payload inline when at most ``INLINE_MAX`` bytes); a
  larger payload goes as one message on the data tag, straight from the sender's buffer into a pooled
  receive buffer, posted at once. The receiver keeps ``CONTROL_RING`` control receives posted; as it
  parses a batch it copies inline payloads into pooled buffers and posts each large payload's receive
  (tag matching keeps payloads in order), so many payloads move at once; frames reach the session in
  order.

- **Checksums on the worker's thread.** A sender computes each payload's checksum as it posts the payload
  and a receiver checks it in the payload's completion, so a push's verdict is known when its last byte
  lands (``verify_thread_min_bytes`` defaults to 0 here; :mod:`transport.verify`'s thread stays available
  by setting it). Over UCX the worker's own thread does the copy (``process_vm_readv`` over shared memory,
  socket reads over tcp), so there is no idle wire time for a thread to fill: on this two-core host the
  thread's hand-offs (a wake per payload, the verdict back through ``call_soon_threadsafe`` and the GIL,
  0.76-1.0 ms after the payload landed for a ~35 us hash) held each push's window longer than the hash
  itself takes, and its two extra threads took cores from the two progress loops. Locked A/B, same run,
  host under other work (``/tmp`` harness: kvmesh sender and receiver, 64 MiB of 4 x 1 MiB pushes,
  alternating, six rounds each, two runs), receiver thread CPU per MiB and median GB/s, thread -> inline:
  sm 595 -> 503 and 582 -> 482 us/MiB, 1.76 -> 2.01 and 1.63 -> 2.14 GB/s; tcp 758 -> 735 and 744 -> 746
  us/MiB, 0.67 -> 0.74 and 1.44 -> 1.40 GB/s.

Connecting: the initiator opens an endpoint to the server and sends a hello (a connection id, whether
it uses error handling, and its own worker address) on the server's hello tag; the server opens an
endpoint back; both directions then use tags derived from (server, connection, direction).

Backpressure: ``drain`` waits while more than ``WRITE_HIGH_WATER`` bytes are posted and not yet
sent; the receiver posts no payload receive until the pool lends a buffer.

Failure behaviour: as for every framed backend (typed errors, nothing left staged). UCX errors map to
``PeerGone`` (or ``ConnectError`` while connecting) in :func:`transport.base.translate`. An endpoint
without error handling does not fail when its peer dies, so a call to a dead peer on this host ends
at its deadline with ``TransferTimeout``, and an initiator that closes says goodbye so its server
drops the connection (one whose initiator died without a word stays until the server closes). A
payload receive cancelled or failed when a connection dies gives its buffer up for good
(``Lease.discard``), so a late write can never corrupt a recycled buffer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

from transport.base import (
    Address,
    Block,
    ClockLike,
    ConnectError,
    FrameError,
    PeerGone,
    Site,
    TransportOptions,
    translate,
)
from transport.checksum import ChecksumChoice, checksum_of, pick
from transport.frame import HEADER_SIZE, Frame, FrameType, Header, Limits, encode, parse_header
from transport.pool import BufferPool, Lease
from transport.session import Client, FramedTransport, Handler
from transport.ucx_worker import UcxWorker, _ucxx, close_endpoint, ucx_available

__all__ = ["UcxConnection", "UcxTransport", "UcxWorker", "close_endpoint", "host_identity", "ucx_available"]

log = logging.getLogger(__name__)

WRITE_HIGH_WATER = 32 << 20
WRITE_LOW_WATER = 8 << 20
CONTROL_RING = 32
"""Control receives each connection keeps posted (frames whose headers can arrive ahead of their payloads)."""
INLINE_MAX = 16 * 1024
"""Payloads up to this size travel inside the control message, after their frame's metadata (protocol constant)."""
_BATCH_LEN = struct.Struct("<I")
HELLO_SIZE = 4096
_EMPTY = memoryview(b"")
_HELLO = struct.Struct("<8sBH")


def host_identity() -> bytes:
    """This host's identity: host name, boot id (two containers may share a host name) and network
    namespace (the hosts harness's hosts share the first two; each must reach the others as remote)."""
    boot = b""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id", "rb") as f:
        boot = f.read().strip()
    netns = b""
    with contextlib.suppress(OSError):
        netns = str(os.stat("/proc/self/ns/net").st_ino).encode()
    return socket.gethostname().encode() + b"/" + boot + b"/" + netns


def _tag(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"|".join(parts), digest_size=8).digest(), "little")



class _Slot:
    """A frame between its control message and its delivery (its payload may still be arriving)."""

    __slots__ = ("done", "header", "intact", "lease", "meta")

    def __init__(self, header: Header, meta: dict[str, Any], lease: Lease | None) -> None:
        self.header = header
        self.meta = meta
        self.lease = lease
        self.done = lease is None
        self.intact: bool | None = None
        """The payload's verdict when the worker's verifier checked it (None: check it on delivery)."""


class _CtrlRecv:
    """One posted control receive: its buffer (with the view and ucxx ``Array`` over it, made once, since it
    is posted again as soon as it is parsed), whether it arrived, the parse offset and the batch's end."""

    __slots__ = ("arr", "arrived", "buf", "done", "end", "pos", "view")

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.arr = UcxWorker.array(self.buf)
        self.arrived = False
        self.pos = 0
        self.end = 0
        self.done: Callable[[BaseException | None], None] | None = None


class UcxConnection:
    """One UCX connection carrying frames (see the module docstring); implements ``session.Connection``."""

    def __init__(self, w: UcxWorker, ep: Any, tags: tuple[int, int, int, int], pool: BufferPool, limits: Limits,
                 make_handler: Callable[[UcxConnection], Handler],
                 on_frame_error: Callable[[FrameError], None] | None = None) -> None:
        self.w = w
        self.ep = ep
        self.tag_ctrl_out, self.tag_data_out, self.tag_ctrl_in, self.tag_data_in = tags
        self.pool = pool
        self.limits = limits
        self.lost: asyncio.Future[None] = w.loop.create_future()
        self._queued = 0
        self._space = asyncio.Event()
        self._space.set()
        self._closed = False
        self._on_frame_error = on_frame_error
        self.bye_on_close = False
        """Send a goodbye before closing (an endpoint without error handling tells its peer nothing)."""
        self._ctrl: collections.deque[_CtrlRecv] = collections.deque()
        """Posted control receives, in order."""
        self._frames: collections.deque[_Slot] = collections.deque()
        self._unlisten: Callable[[], None] | None = None
        self._delivering = False
        self._batch: list[bytes | memoryview] = []
        self._batch_bytes = 0
        self._flush_scheduled = False
        self._on_empty: Callable[[], None] | None = None
        """Called once everything queued was sent (a closing initiator's goodbye)."""
        self.handler = make_handler(self)
        self._ctrl_size = _BATCH_LEN.size + HEADER_SIZE + limits.max_meta_bytes + INLINE_MAX
        for _ in range(CONTROL_RING):
            entry = _CtrlRecv(self._ctrl_size)
            entry.done = functools.partial(self._ctrl_done, entry)
            self._post_ctrl(entry)

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def ready(self) -> bool:
        return not self._closed and self._space.is_set()

    # -- sending ---------------------------------------------------------------------------------
    def send(self, ftype: FrameType, meta: dict[str, Any], payload: memoryview | None = None, *,
             block: Block | None = None, algo: ChecksumChoice = "auto") -> None:
        """Queue one frame and return at once (see the module docstring for how frames travel).

        The frame's header and metadata (and its payload, when at most ``INLINE_MAX`` bytes) join the
        connection's current control batch, posted as one message at the end of this loop iteration
        (or at once when full); a larger payload is posted now as its own data message.
        """
        if self._closed:
            raise PeerGone("connection closed")
        if block is not None:
            head, body = encode(ftype, meta, block.payload, checksum=block.checksum,
                                algo=block.checksum_algo if block.checksum is not None else pick(algo, block.nbytes))
        else:
            head, body = encode(ftype, meta, payload, algo=pick(algo, 0 if payload is None else payload.nbytes))
        self._queue(head, body)

    def send_encoded(self, head: bytes, body: memoryview | None = None) -> None:
        """Queue a frame already encoded (a compact ACK, a small push), as ``send`` queues one it encoded."""
        if self._closed:
            raise PeerGone("connection closed")
        self._queue(head, _EMPTY if body is None else body)

    def _queue(self, head: bytes, body: memoryview) -> None:
        inline = body.nbytes <= INLINE_MAX
        size = len(head) + (body.nbytes if inline else 0)
        if self._batch_bytes + size > self._ctrl_size - _BATCH_LEN.size:
            self._flush()
        self._batch.append(head)
        if inline and body.nbytes:
            self._batch.append(body)
        self._batch_bytes += size
        self._queued += len(head) + body.nbytes
        if not inline:
            self.w.send(self.ep, body, self.tag_data_out, functools.partial(self._sent, body.nbytes))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.w.loop.call_soon(self._flush)
        if self._queued > WRITE_HIGH_WATER:
            self._space.clear()

    def _flush(self) -> None:
        """Post the control batch: its length, then its frames back to back."""
        self._flush_scheduled = False
        if not self._batch or self._closed:
            return
        n = self._batch_bytes
        msg = b"".join([_BATCH_LEN.pack(n), *self._batch])
        self._batch.clear()
        self._batch_bytes = 0
        self.w.send(self.ep, msg, self.tag_ctrl_out, functools.partial(self._sent, n))

    def _sent(self, n: int, exc: BaseException | None) -> None:
        self._queued -= n
        if exc is not None:
            self._lose(exc)
            return
        if self._queued <= WRITE_LOW_WATER:
            self._space.set()
        if self._queued <= 0 and self._on_empty is not None:
            self._on_empty()

    async def drain(self) -> None:
        while True:
            if self._closed:
                raise PeerGone("connection closed")
            if self._space.is_set():
                return
            await self._space.wait()

    # -- receiving -------------------------------------------------------------------------------
    def _post_ctrl(self, entry: _CtrlRecv) -> None:
        entry.arrived, entry.pos, entry.end = False, 0, 0
        self._ctrl.append(entry)
        assert entry.done is not None
        self.w.recv(self.ep, entry.buf, self.tag_ctrl_in, entry.done, entry.arr)

    def _ctrl_done(self, entry: _CtrlRecv, exc: BaseException | None) -> None:
        if self._closed:
            return
        if exc is not None:
            self._lose(exc)
            return
        entry.arrived = True
        self._pump()

    def _pump(self) -> None:
        """Parse arrived control batches in order; inline payloads are copied into pooled buffers, others
        get their receive posted into one (data messages arrive in the order their headers were parsed)."""
        try:
            while not self._closed and self._ctrl and self._ctrl[0].arrived and self._unlisten is None:
                entry = self._ctrl[0]
                view = entry.view
                if entry.pos == 0:
                    (n,) = _BATCH_LEN.unpack_from(view)
                    if n > len(view) - _BATCH_LEN.size:
                        raise FrameError(f"control batch of {n} bytes overruns its {len(view)}-byte buffer")
                    entry.pos = _BATCH_LEN.size
                    entry.end = _BATCH_LEN.size + n
                end = entry.end
                while entry.pos < end:
                    if not self._parse_one(view, entry, end):
                        return  # waiting for the pool
                self._ctrl.popleft()
                self._post_ctrl(entry)
        except FrameError as e:
            self._frame_error(e)
            return
        self._deliver()

    def _parse_one(self, view: memoryview, entry: _CtrlRecv, end: int) -> bool:
        """Parse the frame at ``entry``'s offset; False (offset unchanged) while the pool has no buffer."""
        pos = entry.pos
        if end - pos < HEADER_SIZE:
            raise FrameError("control batch ends inside a frame header")
        h = parse_header(view[pos:pos + HEADER_SIZE], self.limits)
        body = pos + HEADER_SIZE + h.meta_len
        inline = h.payload_len <= INLINE_MAX
        stop = body + (h.payload_len if inline else 0)
        if stop > end:
            raise FrameError("control batch ends inside a frame")
        lease = None
        if h.payload_len:
            lease = self.pool.acquire(h.payload_len)
            if lease is None:  # pool exhausted: wait for a release (backpressure)
                self._unlisten = self.pool.on_release(self._pool_released)
                return False
        try:
            meta = h.check_meta(view[pos + HEADER_SIZE:body])
        except FrameError:
            if lease is not None:
                lease.release()
            raise
        slot = _Slot(h, meta, lease)
        self._frames.append(slot)
        if lease is not None:
            if inline:
                lease.view[:] = view[body:stop]
                slot.done = True
            else:
                self.w.recv(self.ep, lease.view, self.tag_data_in, functools.partial(self._data_done, slot))
        entry.pos = stop
        return True

    def _pool_released(self) -> None:
        self.w.loop.call_soon(self._retry_pool)  # never re-enter the reader from inside a release

    def _retry_pool(self) -> None:
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        self._pump()

    def _data_done(self, slot: _Slot, exc: BaseException | None) -> None:
        if exc is not None or self._closed:
            if slot.lease is not None:
                slot.lease.discard()  # cancelled or failed: UCX may have written into it
                slot.lease = None
            if exc is not None:
                self._lose(exc)
            return
        h = slot.header
        if (self.w.verifier is not None and self.w.verify_min and h.payload_len >= self.w.verify_min
                and slot.lease is not None):
            # verified off the loop's thread while the loop receives on; not done (nor recyclable) until then
            self.w.verifier.submit(h.algo, slot.lease.view, h.checksum, functools.partial(self._verified, slot))
            return
        slot.done = True
        self._deliver()

    def _verified(self, slot: _Slot, intact: bool) -> None:
        if self._closed:
            return  # the slot's buffer was discarded with the connection
        slot.intact = intact
        slot.done = True
        self._deliver()

    def _deliver(self) -> None:
        if self._delivering:
            return
        self._delivering = True
        try:
            while not self._closed and self._frames and self._frames[0].done:
                slot = self._frames.popleft()
                h = slot.header
                if slot.lease is not None:
                    view = slot.lease.view
                    intact = checksum_of(h.algo, view) == h.checksum if slot.intact is None else slot.intact
                    frame = Frame(h.type, slot.meta, view, slot.lease, h.checksum, h.algo, intact, h.small)
                    slot.lease = None
                else:
                    frame = Frame(h.type, slot.meta, _EMPTY, None, 0, h.algo, True, h.small)
                try:
                    self.handler.on_frame(frame)
                except FrameError as e:
                    frame.release()
                    self._frame_error(e)
                    return
        finally:
            self._delivering = False

    def _frame_error(self, e: FrameError) -> None:
        log.warning("closing UCX connection: %s", e)
        if self._on_frame_error is not None:
            self._on_frame_error(e)
        self._lose(e)

    # -- closing ---------------------------------------------------------------------------------
    def abort(self) -> None:
        """Close now (a reset)."""
        self._lose(None)

    def close(self) -> None:
        """Close; an initiator without error handling first says goodbye (its server could not tell)."""
        if not (self.bye_on_close and not self._closed):
            self._lose(None)
            return
        self.bye_on_close = False
        try:
            self.send(FrameType.CANCEL, {"t": 0, "bye": True})
            self._flush()
        except Exception:
            self._lose(None)
            return
        self._on_empty = lambda: self._lose(None)
        self.w.loop.call_later(0.5, self._lose, None)  # in case the goodbye never completes

    def _lose(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        close_endpoint(self.ep)  # cancels the receives still posted on it
        for slot in self._frames:
            if slot.lease is not None:
                if slot.done:
                    slot.lease.release()
                else:
                    slot.lease.discard()
                slot.lease = None
        self._frames.clear()
        self._ctrl.clear()
        self._batch.clear()
        self._batch_bytes = 0
        self._queued = 0
        self._space.set()
        try:
            self.handler.on_lost(translate(exc, "ucx connection") if exc is not None else None)
        finally:
            if not self.lost.done():
                self.lost.set_result(None)


def ucx_options(options: TransportOptions | None) -> TransportOptions:
    """``options`` with ucx's own default for ``verify_thread_min_bytes``: 0 (every checksum computed and
    checked on the worker's thread) unless the caller set it (see the module docstring)."""
    o = options if options is not None else TransportOptions()
    if "verify_thread_min_bytes" in o.model_fields_set:
        return o
    return o.model_copy(update={"verify_thread_min_bytes": 0})


class UcxTransport(FramedTransport):
    """KV transport over UCX (see the module docstring and :mod:`transport.session`)."""

    name = "ucx"
    coalesce_bytes = INLINE_MAX
    """A table frame's payload travels inside the control message, as the blocks' own frames would."""

    def __init__(self, site: Site, clock: ClockLike, options: TransportOptions | None = None) -> None:
        super().__init__(site, clock, ucx_options(options))
        _ucxx()  # fail here, with the install hint, when ucxx is missing
        self._w: UcxWorker | None = None
        self._listener: Any = None
        self._accepted_eps: list[Any] = []
        self._uid = secrets.token_bytes(8)
        self._address: Address | None = None
        self._host = host_identity()
        self._hello_buf = bytearray(HELLO_SIZE)
        self.paths: collections.Counter[str] = collections.Counter()
        """Connections opened, by path: ``worker_address`` (same host), ``remote`` (another host), ``listener``."""

    @property
    def inflight_bytes(self) -> int:
        return min(self.options.max_inflight_bytes, self.options.ucx_inflight_bytes)

    def _worker(self) -> UcxWorker:
        if self._w is None:
            self._w = UcxWorker(self.verifier, self.options.verify_thread_min_bytes)
        return self._w

    async def serve(self) -> Address:
        self._check_open()
        if self._address is not None:
            return self._address
        w = self._worker()
        self._listener = w.lib.UCXListener.create(w.worker, self.options.port, self._on_conn_request,
                                                  deliver_endpoint=True)
        self._post_hello()
        self._address = Address("ucx", f"{self.options.advertise_host or self.options.host}:{self._listener.port}",
                                self.site,
                                extra=(("worker", w.address), ("host", self._host), ("uid", self._uid)))
        return self._address

    # -- accepting -------------------------------------------------------------------------------
    def _on_conn_request(self, ep: Any) -> None:
        """A peer connected through the listener (UCX accepted it); its hello follows on the hello tag."""
        self._accepted_eps.append(ep)

    def _post_hello(self) -> None:
        assert self._w is not None
        self._w.recv_any(self._hello_buf, _tag(b"hello", self._uid), self._on_hello)

    def _on_hello(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        if exc is None:
            try:
                self._accept(bytes(self._hello_buf))
            except Exception as e:  # a bad hello must not stop accepting
                log.warning("ignoring a UCX hello: %s", e)
        self._post_hello()

    def _accept(self, hello: bytes) -> None:
        conn_id, flags, n = _HELLO.unpack_from(hello)
        if n > HELLO_SIZE - _HELLO.size:
            raise FrameError("malformed UCX hello")
        w = self._worker()
        ep = w.endpoint(hello[_HELLO.size:_HELLO.size + n], bool(flags & 1))
        tags = (_tag(self._uid, conn_id, b"s2c-c"), _tag(self._uid, conn_id, b"s2c-d"),
                _tag(self._uid, conn_id, b"c2s-c"), _tag(self._uid, conn_id, b"c2s-d"))
        self._track(UcxConnection(w, ep, tags, self.pool, self.limits, self._accepted, self._count_frame_error))

    # -- connecting ------------------------------------------------------------------------------
    def _same_host(self, address: Address) -> bool:
        mode = self.options.ucx_same_host
        if mode == "listener":
            return False
        return mode == "worker_address" or address.get("host") == self._host

    async def _open(self, address: Address, client: Client) -> UcxConnection:
        w = self._worker()
        worker, uid = address.get("worker"), address.get("uid")
        listener = self.options.ucx_same_host == "listener" or worker is None
        if uid is None:
            raise ConnectError(f"{address} carries no UCX endpoint id (not a ucx address)")
        same = not listener and self._same_host(address)
        conn_id = secrets.token_bytes(8)
        try:
            async with asyncio.timeout(self.options.connect_timeout_ms / 1000.0):
                if listener:
                    host, _, port = address.location.rpartition(":")
                    ep = w.lib.UCXEndpoint.create(w.worker, host, int(port), True)
                    path = "listener"
                else:
                    assert worker is not None
                    ep = w.endpoint(worker, error_handling=not same)
                    path = "worker_address" if same else "remote"
                hello = bytearray(HELLO_SIZE)
                _HELLO.pack_into(hello, 0, conn_id, 0 if same else 1, len(w.address))
                hello[_HELLO.size:_HELLO.size + len(w.address)] = w.address
                await w.wait_send(ep, hello, _tag(b"hello", uid))
        except TimeoutError as e:
            raise ConnectError(f"connect to {address} timed out") from e
        except Exception as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ConnectError(f"cannot connect to {address}: {type(e).__name__}: {e}") from e
        self.paths[path] += 1
        tags = (_tag(uid, conn_id, b"c2s-c"), _tag(uid, conn_id, b"c2s-d"),
                _tag(uid, conn_id, b"s2c-c"), _tag(uid, conn_id, b"s2c-d"))
        conn = UcxConnection(w, ep, tags, self.pool, self.limits, lambda _c: client, self._count_frame_error)
        conn.bye_on_close = True
        return conn

    async def _serving_stopped(self) -> None:
        for ep in self._accepted_eps:
            close_endpoint(ep)
        if self._w is not None:
            await self._w.close()
        # The worker, listener and endpoints stay referenced by this transport (UCX objects released in
        # an arbitrary order crash in their destructors) and go together when it is collected.
