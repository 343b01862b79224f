"""The router's HTTP/1.1 client to its engines: kept-alive connections per engine, one write per request.

Every routed request crosses this client twice (request out, answer back), so it is the router's hot path.
aiohttp's client costs about 0.3 ms of CPU a request on a small host, more than the whole routing decision
(``bench/router.py`` measures the router against sgl-router): this one parses with httptools (llhttp, the
parser Node.js uses) and does little else. The router's feeds (WebSockets) still use aiohttp.

Semantics the router relies on:
- a request is one ``write``; the answer's status and headers come back as soon as they arrive, its body as
  the chunks arrive (chunked transfer decoded), with reading paused while the router has not caught up;
- leaving ``async with`` before the body ended, or cancelling, closes the connection: the engine sees its
  client go and aborts the request (what a client disconnect or a router deadline must do);
- a kept-alive connection the engine closed while idle is retried once on a fresh one, before any byte of
  the answer; every other failure, connecting included, raises :class:`UpstreamError` and nothing else, so
  the router tells an engine's failure from its own client's disconnect (``ConnectionResetError``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

READ_HIGH_WATER = 256 * 1024
"""Body bytes buffered before reading from the engine pauses."""


class UpstreamError(Exception):
    """The engine could not be reached, its connection failed, or its answer was not valid HTTP."""


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0
        self.received_any = False

    # -- asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.response is None or self.parser is None:
            self._abort()  # bytes nobody asked for: the connection is out of step
            return
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.response._fail(UpstreamError(f"malformed HTTP answer: {e}"))
            self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response._complete:
            why = f"connection lost: {exc}" if exc else "the engine closed the connection"
            self.response._fail(UpstreamError(why), retryable=not self.received_any)

    # -- httptools callbacks -----------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self.response is not None and self.parser is not None
        self.response.status = self.parser.get_status_code()
        if not self.response._head.done():
            self.response._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None and self.parser is not None
        self.reusable = self.parser.should_keep_alive()
        self.response._finish()

    # -- the pool's side ---------------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self.response = response
        self.received_any = False
        self.reusable = False
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def release(self) -> None:
        """Back to the pool when the answer ended cleanly on a kept-alive connection, else closed."""
        done = self.response is not None and self.response._complete and self.response._error is None
        self.response = None
        self.parser = None
        if done and self.reusable and not self.closed:
            self.idle_since = time.monotonic()
            self.pool._idle_put(self)
        else:
            self._abort()


class UpstreamResponse:
    """An engine's answer: ``status`` and ``headers`` (names lower-cased) at once, the body as it comes."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        self._head: asyncio.Future[None] = loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: BaseException | None = None
        self._retryable = False

    # -- fed by the connection ---------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: BaseException, retryable: bool = False) -> None:
        if self._error is None:
            self._error = error
            self._retryable = retryable
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- the router's side -------------------------------------------------------------------------------
    async def chunk(self) -> bytes:
        """The next body bytes as they arrived (b"" at the end of the body)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered <= READ_HIGH_WATER // 2 and self._conn is not None:
            self._paused = False
            self._conn.resume()
        return data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while data := await self.chunk():
            yield data

    async def read(self) -> bytes:
        parts = [data async for data in self]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def text(self) -> str:
        return (await self.read()).decode("utf-8", "replace")

    async def json(self) -> Any:
        data = await self.read()
        try:
            return json.loads(data)
        except ValueError as e:
            raise UpstreamError(f"the engine's answer is not JSON: {e}") from None

    def close(self) -> None:
        """Done with this answer: the connection goes back to the pool if the answer ended, else closes."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is not None:
            conn.release()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class UpstreamPool:
    """Kept-alive HTTP/1.1 connections to each engine, reused most recent first."""

    def __init__(self, *, connect_timeout_s: float = 5.0, idle_timeout_s: float = 30.0,
                 max_idle_per_engine: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle = max_idle_per_engine
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._hosts: dict[str, tuple[str, int, bytes]] = {}
        self.connects = 0

    def _target(self, base_url: str) -> tuple[str, int, bytes]:
        t = self._hosts.get(base_url)
        if t is None:
            u = urlsplit(base_url)
            if u.scheme != "http" or not u.hostname:
                raise UpstreamError(f"unsupported engine URL {base_url!r} (plain http://host:port only)")
            port = u.port or 80
            t = self._hosts[base_url] = (u.hostname, port, f"{u.hostname}:{port}".encode())
        return t

    def _idle_put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn._abort()
            return
        idle.append(conn)

    def _idle_get(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_timeout_s:
                return conn
            conn._abort()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        self.connects += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1])
        except (OSError, TimeoutError) as e:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {type(e).__name__}: {e}") from None
        return conn

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send one request and return once the answer's status and headers arrived."""
        host, port, host_header = self._target(base_url)
        key = (host, port)
        lines = [f"{method} {path} HTTP/1.1\r\n".encode(), b"Host: " + host_header + b"\r\n",
                 b"Content-Length: %d\r\n" % len(body)]
        for k, v in (headers or {}).items():
            lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        head = b"".join(lines)
        for _ in range(2):
            conn = self._idle_get(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            resp = UpstreamResponse(conn)
            conn.send(head, body, resp)
            try:
                await resp._head
            except UpstreamError:
                resp.close()
                if reused and resp._retryable:
                    continue  # the engine had closed this idle connection: once more on a fresh one
                raise
            except BaseException:
                resp.close()  # cancelled: the engine sees the connection go
                raise
            return resp
        raise AssertionError("unreachable")

    async def post(self, base_url: str, path: str, body: bytes,
                   headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        return await self.request("POST", base_url, path, body, headers)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn._abort()
        self._idle.clear()
