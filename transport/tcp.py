"""TCP backend: asyncio sockets carrying the frames of :mod:`transport.frame`, one session per connection.

The protocol over each connection (pushes, pulls, commits, cancellation, backpressure, failure
behaviour) is :mod:`transport.session`'s. This module adds the socket: a ``BufferedProtocol`` that
receives straight into the frame decoder's pooled buffers, pauses reading while the pool is
exhausted, honours the socket's write flow control, and closes only its own connection on bytes
that are not frames. Servers bind ``TransportOptions.host`` (127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

from transport.base import (
    Address,
    Block,
    ConnectError,
    FrameError,
    PeerGone,
)
from transport.checksum import ChecksumChoice, pick
from transport.frame import Frame, FrameDecoder, FrameType, Limits, encode
from transport.pool import BufferPool
from transport.session import Client, FramedTransport, Handler
from transport.verify import Verifier

log = logging.getLogger(__name__)

WRITE_HIGH_WATER = 4 << 20
WRITE_LOW_WATER = 1 << 20
SMALL_WRITE = 64 * 1024


class FrameConnection(asyncio.BufferedProtocol):
    """One socket: frames in through a decoder into pooled buffers, frames out with flow control.

    Large xxh3 payloads (the senders' default) are verified by the decoder as their bytes land (hashed
    piece by piece while still in cache, :mod:`transport.frame`). With a ``verifier``, other payloads of
    at least ``verify_min`` bytes are checked on its thread while the socket is read on
    (:mod:`transport.verify`): such a frame, and every frame after it, waits in ``_held`` until its
    verdict, so the handler still sees every frame in order and verified. Frames held when the
    connection ends are dropped (a buffer still being checked is discarded, not recycled).
    """

    def __init__(self, pool: BufferPool, limits: Limits, make_handler: Callable[[FrameConnection], Handler],
                 on_frame_error: Callable[[FrameError], None] | None = None, verifier: Verifier | None = None,
                 verify_min: int = 0) -> None:
        self.decoder = FrameDecoder(pool, limits, verify_min if verifier is not None else 0)
        self._verifier = verifier
        self._held: collections.deque[Frame] = collections.deque()
        self._lost = False
        self.pool = pool
        self.handler = make_handler(self)
        self.decoder.direct = self.handler  # ACKs and small pushes go to the handler inside the read callback
        self.transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._unlisten: Callable[[], None] | None = None
        self._on_frame_error = on_frame_error
        self._failed = False
        self._gather = False

    # -- asyncio callbacks -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self._gather = type(transport).__module__.startswith("uvloop")
        """uvloop's ``writelines`` sends its buffers with one writev and keeps views of them; asyncio's (3.11) joins
        them into one copy first, so there a large frame goes as two writes."""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)

    def get_buffer(self, sizehint: int) -> memoryview:
        try:
            return self.decoder.get_buffer(sizehint)
        except FrameError as e:
            self.fail(e)
            return memoryview(bytearray(1))  # discarded: the transport is aborted

    def buffer_updated(self, nbytes: int) -> None:
        if self._failed:
            return
        try:
            frames = self.decoder.buffer_updated(nbytes)
        except FrameError as e:
            self.fail(e)
            return
        if frames or self.decoder.waiting_for_buffer:
            self._dispatch(frames)

    def _dispatch(self, frames: list[Frame]) -> None:
        for i, f in enumerate(frames):
            if not f.verified:
                assert self._verifier is not None
                self._verifier.submit(f.algo, f.payload, f.checksum, functools.partial(self._verdict, f))
            if self._held or not f.verified:
                self._held.append(f)  # in order behind a frame still being checked
                self.decoder.direct = None  # and so are the frames after it, until it is checked
            elif not self._handle(f):
                for rest in frames[i + 1:]:
                    rest.release()
                return
        if self.decoder.waiting_for_buffer and self._unlisten is None and self.transport is not None:
            self.transport.pause_reading()
            loop = asyncio.get_running_loop()

            def later() -> None:  # never re-enter the decoder from inside a release
                loop.call_soon(self._retry_pool)

            self._unlisten = self.pool.on_release(later)

    def _handle(self, f: Frame) -> bool:
        """Hand one frame to the handler; False (connection failed, held frames dropped) on a FrameError."""
        try:
            self.handler.on_frame(f)
        except FrameError as e:
            f.release()
            self._drop_held()
            self.fail(e)
            return False
        return True

    def _verdict(self, f: Frame, intact: bool) -> None:
        f.intact, f.verified = intact, True
        if self._lost or self._failed:
            return  # dropped with the connection
        while self._held and self._held[0].verified:
            if not self._handle(self._held.popleft()):
                return
        if not self._held:
            self.decoder.direct = self.handler

    def _drop_held(self) -> None:
        held, self._held = self._held, collections.deque()
        for f in held:
            if f.verified:
                f.release()
            elif f.lease is not None:
                f.lease.discard()  # the verifier may still be reading it: never recycle it

    def _retry_pool(self) -> None:
        if self._unlisten is None or self.transport is None or self.transport.is_closing():
            return
        try:
            frames = self.decoder.resume()
        except FrameError as e:
            self.fail(e)
            return
        if not self.decoder.waiting_for_buffer:
            self._unlisten()
            self._unlisten = None
            self.transport.resume_reading()
        self._dispatch(frames)

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._drop_held()
        if self._unlisten is not None:
            self._unlisten()
            self._unlisten = None
        self.decoder.close()
        self._can_write.set()
        try:
            self.handler.on_lost(exc)
        finally:
            if not self.lost.done():
                self.lost.set_result(None)

    # -- our side --------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def ready(self) -> bool:
        return self._can_write.is_set() and self.transport is not None and not self.transport.is_closing()

    def fail(self, err: FrameError) -> None:
        """A protocol violation: close this connection (only this one)."""
        if self._failed:
            return
        self._failed = True
        log.warning("closing connection: %s", err)
        if self._on_frame_error is not None:
            self._on_frame_error(err)
        if self.transport is not None:
            self.transport.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """TCP tells the peer itself (FIN or RST): closing is aborting."""
        self.abort()

    async def drain(self) -> None:
        if not self.alive:
            raise PeerGone("connection closed")
        if not self._can_write.is_set():
            await self._can_write.wait()
            if not self.alive:
                raise PeerGone("connection closed")

    def send(self, ftype: FrameType, meta: dict[str, Any], payload: memoryview | None = None, *,
             block: Block | None = None, algo: ChecksumChoice = "auto") -> None:
        """Write one frame now (never interleaved with another). ``block`` supplies payload and checksum."""
        if self.transport is None or self.transport.is_closing():
            raise PeerGone("connection closed")
        if block is not None:
            head, body = encode(ftype, meta, block.payload, checksum=block.checksum,
                                algo=block.checksum_algo if block.checksum is not None else pick(algo, block.nbytes))
        else:
            head, body = encode(ftype, meta, payload, algo=pick(algo, 0 if payload is None else payload.nbytes))
        self._write(head, body)

    def send_encoded(self, head: bytes, body: memoryview | None = None) -> None:
        if self.transport is None or self.transport.is_closing():
            raise PeerGone("connection closed")
        self._write(head, body)

    def _write(self, head: bytes, body: memoryview | None) -> None:
        t = self.transport
        assert t is not None
        if body is None or body.nbytes == 0:
            t.write(head)
        elif body.nbytes < SMALL_WRITE:
            t.write(head + body)  # one write (and syscall) for a small frame
        elif self._gather:
            t.writelines((head, body))  # one writev: no syscall and no TCP segment for the header alone
        else:
            t.write(head)
            t.write(body)


class TcpTransport(FramedTransport):
    """KV transport over TCP (see the module docstring and :mod:`transport.session`)."""

    name = "tcp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._server: asyncio.Server | None = None
        self._address: Address | None = None

    def _connection(self, make_handler: Callable[[FrameConnection], Handler]) -> FrameConnection:
        return FrameConnection(self.pool, self.limits, make_handler, self._count_frame_error, self.verifier,
                               self.options.verify_thread_min_bytes)

    async def serve(self) -> Address:
        self._check_open()
        if self._address is not None:
            return self._address
        loop = asyncio.get_running_loop()

        def accept() -> FrameConnection:
            conn = self._connection(self._accepted)
            self._track(conn)
            return conn

        self._server = await loop.create_server(accept, self.options.host, self.options.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self._address = Address("tcp", f"{self.options.advertise_host or host}:{port}", self.site)
        return self._address

    async def _open(self, address: Address, client: Client) -> FrameConnection:
        location = address.location
        host, _, port = location.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.options.connect_timeout_ms / 1000.0):
                _, conn = await loop.create_connection(lambda: self._connection(lambda _c: client), host, int(port))
        except TimeoutError as e:
            raise ConnectError(f"connect to {location} timed out") from e
        except OSError as e:
            raise ConnectError(f"cannot connect to {location}: {e.strerror or e}") from e
        return conn

    def _stop_serving(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serving_stopped(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
