"""UCX backend (``ucxx``, the optional ``ucx`` extra): the session protocol of :mod:`transport.session`
over UCX tagged messages, in host memory.

Each frame travels as up to three messages in order: its 32-byte header, its metadata, its payload
(received straight into a pooled buffer whose size the header announced). One writer task per
connection sends queued frames whole, in order; one reader task receives them and hands them to the
session. Backpressure: ``drain`` waits while more than ``WRITE_HIGH_WATER`` bytes are queued; the
reader waits for the pool (it posts no receive until a buffer is free).

Two ways to connect, chosen per peer:

- Same host (the peer's address names this host): connect by the peer's UCX *worker address*, which
  travels inside its :class:`~transport.base.Address` through Ray, the control plane. UCX then picks
  its shared-memory transports. The initiator sends a hello (its own worker address and a connection
  id) on the server's hello tag; both directions then use tags derived from (server, connection).
- Another host (or ``TransportOptions.ucx_same_host = "listener"``): the server's listener
  (``host:port``), as with TCP.

Failure behaviour: as for every framed backend (typed errors, nothing left staged). UCX errors map to
``PeerGone`` (or ``ConnectError`` while connecting) in :func:`transport.base.translate`. A worker-address
connection has no endpoint that fails when the peer dies, so a call to a dead peer ends at its
deadline with ``TransferTimeout``, and an initiator that closes says goodbye so its server drops the
connection (one whose initiator died without a word stays until the server closes). A receive
still posted when a connection dies keeps its buffer out of the pool for good (UCX may still write
into it), so a late message can never corrupt a recycled buffer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
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
from transport.frame import HEADER_SIZE, Frame, FrameType, Limits, encode, parse_header
from transport.pool import BufferPool, Lease
from transport.session import Client, FramedTransport, Handler

log = logging.getLogger(__name__)

WRITE_HIGH_WATER = 8 << 20
WRITE_LOW_WATER = 2 << 20
HELLO_SIZE = 4096
_EMPTY = memoryview(b"")


def _ucxx() -> Any:
    """The ucxx module, imported on first use (it reads UCX settings from the environment when imported)."""
    try:
        import ucxx
    except ImportError as e:
        raise RuntimeError("the 'ucx' transport backend needs ucxx: install the 'ucx' extra "
                           "(pip install -e '.[ucx]')") from e
    return ucxx


def host_identity() -> bytes:
    """This host's identity: host name and boot id (two containers may share a host name)."""
    boot = b""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id", "rb") as f:
        boot = f.read().strip()
    return socket.gethostname().encode() + b"/" + boot


def _tag(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"|".join(parts), digest_size=8).digest(), "little")


class _EndpointIO:
    """Messages over a connected UCX endpoint (listener path): the endpoint's own tags."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep

    async def send(self, buf: Any) -> None:
        await self.ep.send(buf)

    async def recv(self, buf: Any) -> None:
        await self.ep.recv(buf)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ep.abort()


class _WorkerIO:
    """Messages by worker address (same host): send on the peer's endpoint, receive on this worker."""

    def __init__(self, ep: Any, tag_out: int, tag_in: int) -> None:
        self.ep = ep
        self.tag_out = tag_out
        self.tag_in = tag_in

    async def send(self, buf: Any) -> None:
        await self.ep.send(buf, tag=self.tag_out, force_tag=True)

    async def recv(self, buf: Any) -> None:
        await _ucxx().recv(buf, tag=self.tag_in)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ep.abort()


class UcxConnection:
    """One UCX connection carrying frames (see the module docstring); implements ``session.Connection``."""

    def __init__(self, io: _EndpointIO | _WorkerIO, pool: BufferPool, limits: Limits,
                 make_handler: Callable[[UcxConnection], Handler],
                 on_frame_error: Callable[[FrameError], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.io = io
        self.pool = pool
        self.limits = limits
        self.lost: asyncio.Future[None] = loop.create_future()
        self._queue: collections.deque[tuple[bytes, memoryview]] = collections.deque()
        self._queued = 0
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._pool_freed = asyncio.Event()
        self._closed = False
        self._on_frame_error = on_frame_error
        self.bye_on_close = False
        """Send a goodbye before closing (initiators by worker address: their server sees no error)."""
        self._closing: asyncio.Task[None] | None = None
        self.handler = make_handler(self)
        self._tasks = {loop.create_task(self._write_loop()), loop.create_task(self._read_loop())}
        for t in self._tasks:
            t.add_done_callback(self._task_done)

    @property
    def alive(self) -> bool:
        return not self._closed

    def send(self, ftype: FrameType, meta: dict[str, Any], payload: memoryview | None = None, *,
             block: Block | None = None, algo: ChecksumChoice = "auto") -> None:
        if self._closed:
            raise PeerGone("connection closed")
        if block is not None:
            head, body = encode(ftype, meta, block.payload, checksum=block.checksum,
                                algo=block.checksum_algo if block.checksum is not None else pick(algo, block.nbytes))
        else:
            head, body = encode(ftype, meta, payload, algo=pick(algo, 0 if payload is None else payload.nbytes))
        self._queue.append((head, body))
        self._queued += len(head) + body.nbytes
        self._wake.set()
        if self._queued > WRITE_HIGH_WATER:
            self._space.clear()

    async def drain(self) -> None:
        while True:
            if self._closed:
                raise PeerGone("connection closed")
            if self._space.is_set():
                return
            await self._space.wait()

    def abort(self) -> None:
        """Close now (a reset)."""
        self._lose(None)

    def close(self) -> None:
        """Close; an initiator by worker address first says goodbye (its server could not tell)."""
        if not (self.bye_on_close and not self._closed):
            self._lose(None)
            return
        self.bye_on_close = False
        with contextlib.suppress(PeerGone):
            self.send(FrameType.CANCEL, {"t": 0, "bye": True})
        self._closing = asyncio.get_running_loop().create_task(self._close_after_flush())
        self._tasks.add(self._closing)

    async def _close_after_flush(self) -> None:
        for _ in range(50):  # up to about 0.5 s for the goodbye to leave
            if not self._queue or self._closed:
                break
            await asyncio.sleep(0.01)
        self._lose(None)

    # -- tasks -----------------------------------------------------------------------------------
    async def _write_loop(self) -> None:
        try:
            while not self._closed:
                while not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                head, body = self._queue[0]
                await self.io.send(head[:HEADER_SIZE])
                await self.io.send(head[HEADER_SIZE:])
                if body.nbytes:
                    await self.io.send(body)
                self._queue.popleft()
                self._queued -= len(head) + body.nbytes
                if self._queued <= WRITE_LOW_WATER:
                    self._space.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._lose(e)

    async def _read_loop(self) -> None:
        header = bytearray(HEADER_SIZE)
        try:
            while not self._closed:  # a frame handler may have closed the connection
                await self.io.recv(header)
                h = parse_header(memoryview(header), self.limits)
                meta_b = bytearray(h.meta_len)
                if h.meta_len:
                    await self.io.recv(meta_b)
                meta = h.check_meta(memoryview(meta_b))
                if h.payload_len:
                    lease = await self._acquire(h.payload_len)
                    try:
                        await self.io.recv(lease.view)
                    except BaseException:
                        lease.discard()  # UCX may still write into it: never reuse it
                        raise
                    intact = checksum_of(h.algo, lease.view) == h.checksum
                    frame = Frame(h.type, meta, lease.view, lease, h.checksum, h.algo, intact)
                else:
                    frame = Frame(h.type, meta, _EMPTY, None, 0, h.algo)
                try:
                    self.handler.on_frame(frame)
                except FrameError:
                    frame.release()
                    raise
        except asyncio.CancelledError:
            raise
        except FrameError as e:
            log.warning("closing UCX connection: %s", e)
            if self._on_frame_error is not None:
                self._on_frame_error(e)
            self._lose(e)
        except Exception as e:
            self._lose(e)

    async def _acquire(self, n: int) -> Lease:
        lease = self.pool.acquire(n)
        if lease is not None:
            return lease
        loop = asyncio.get_running_loop()

        def freed() -> None:  # called inside Lease.release: only schedule the wake-up
            loop.call_soon(self._pool_freed.set)

        remove = self.pool.on_release(freed)
        try:
            while (lease := self.pool.acquire(n)) is None:
                self._pool_freed.clear()
                await self._pool_freed.wait()
            return lease
        finally:
            remove()

    def _lose(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        current = asyncio.current_task()
        for t in self._tasks:
            if t is not current:
                t.cancel()
        self.io.close()
        self._queue.clear()
        self._queued = 0
        self._space.set()
        try:
            self.handler.on_lost(translate(exc, "ucx connection") if exc is not None else None)
        finally:
            self._task_done(None)

    def _task_done(self, _task: asyncio.Task[None] | None) -> None:
        if self._closed and all(t.done() for t in self._tasks) and not self.lost.done():
            self.lost.set_result(None)
        elif not self._closed and _task is not None and _task.done():
            self._lose(None)  # a loop ended on its own: the connection is over


class UcxTransport(FramedTransport):
    """KV transport over UCX (see the module docstring and :mod:`transport.session`)."""

    name = "ucx"

    def __init__(self, site: Site, clock: ClockLike, options: TransportOptions | None = None) -> None:
        super().__init__(site, clock, options)
        self.ucxx = _ucxx()
        self._listener: Any = None
        self._hello: asyncio.Task[None] | None = None
        self._uid = secrets.token_bytes(8)
        self._address: Address | None = None
        self._host = host_identity()
        self.paths: collections.Counter[str] = collections.Counter()
        """Connections opened, by path: ``worker_address`` (same host) or ``listener``."""

    async def serve(self) -> Address:
        self._check_open()
        if self._address is not None:
            return self._address
        ucxx = self.ucxx
        self._listener = ucxx.create_listener(self._on_endpoint, port=self.options.port or None)
        self._hello = asyncio.get_running_loop().create_task(self._accept_hellos())
        worker = ucxx.get_worker_address().tobytes()
        self._address = Address("ucx", f"{self.options.host}:{self._listener.port}", self.site,
                                extra=(("worker", worker), ("host", self._host), ("uid", self._uid)))
        return self._address

    # -- accepting -------------------------------------------------------------------------------
    async def _on_endpoint(self, ep: Any) -> None:
        if self._closed:
            with contextlib.suppress(Exception):
                ep.abort()
            return
        conn = UcxConnection(_EndpointIO(ep), self.pool, self.limits, self._accepted, self._count_frame_error)
        self._track(conn)
        await asyncio.shield(conn.lost)

    async def _accept_hellos(self) -> None:
        ucxx = self.ucxx
        hello_tag = _tag(b"hello", self._uid)
        buf = bytearray(HELLO_SIZE)
        while True:
            await ucxx.recv(buf, tag=hello_tag)
            try:
                conn_id, n = struct.unpack_from("<8sH", buf)
                if n > HELLO_SIZE - 10:
                    raise FrameError("malformed UCX hello")
                peer = ucxx.get_ucx_address_from_buffer(bytes(buf[10:10 + n]))
                ep = await ucxx.create_endpoint_from_worker_address(peer)
            except Exception as e:  # a bad hello must not stop the accept loop
                log.warning("ignoring a UCX hello: %s", e)
                continue
            io = _WorkerIO(ep, tag_out=_tag(self._uid, conn_id, b"s2c"), tag_in=_tag(self._uid, conn_id, b"c2s"))
            self._track(UcxConnection(io, self.pool, self.limits, self._accepted, self._count_frame_error))

    # -- connecting ------------------------------------------------------------------------------
    def _same_host(self, address: Address) -> bool:
        mode = self.options.ucx_same_host
        if mode == "listener" or address.get("worker") is None or address.get("uid") is None:
            return False
        return mode == "worker_address" or address.get("host") == self._host

    async def _open(self, address: Address, client: Client) -> UcxConnection:
        ucxx = self.ucxx
        timeout = self.options.connect_timeout_ms / 1000.0
        try:
            async with asyncio.timeout(timeout):
                if self._same_host(address):
                    worker, uid = address.get("worker"), address.get("uid")
                    assert worker is not None and uid is not None
                    ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(worker))
                    conn_id = secrets.token_bytes(8)
                    mine = ucxx.get_worker_address().tobytes()
                    hello = bytearray(HELLO_SIZE)
                    struct.pack_into("<8sH", hello, 0, conn_id, len(mine))
                    hello[10:10 + len(mine)] = mine
                    io: _EndpointIO | _WorkerIO = _WorkerIO(ep, tag_out=_tag(uid, conn_id, b"c2s"),
                                                           tag_in=_tag(uid, conn_id, b"s2c"))
                    await ep.send(hello, tag=_tag(b"hello", uid), force_tag=True)
                    self.paths["worker_address"] += 1
                else:
                    host, _, port = address.location.rpartition(":")
                    ep = await ucxx.create_endpoint(host, int(port), connect_timeout=timeout)
                    io = _EndpointIO(ep)
                    self.paths["listener"] += 1
        except TimeoutError as e:
            raise ConnectError(f"connect to {address} timed out") from e
        except Exception as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ConnectError(f"cannot connect to {address}: {type(e).__name__}: {e}") from e
        conn = UcxConnection(io, self.pool, self.limits, lambda _c: client, self._count_frame_error)
        conn.bye_on_close = isinstance(io, _WorkerIO)
        return conn

    def _stop_serving(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._hello is not None:
            self._hello.cancel()

    async def _serving_stopped(self) -> None:
        if self._hello is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._hello


def ucx_available() -> str | None:
    """None when ucxx imports here, else why not (for tests and benchmarks that skip)."""
    try:
        _ucxx()
    except Exception as e:
        return f"{e} ({e.__cause__})" if e.__cause__ else str(e)
    return None
