"""The router's HTTP/1.1 server: httptools (llhttp) parsing on an asyncio protocol, and little else.

Every request the router proxies crosses its server and its client once each, so their cost is the
router's overhead. aiohttp's server spent about 0.15 ms of CPU a request here, as much as all the routing
logic (``bench/router.py`` measures the router beside SGLang's Rust router; the issue's goal is 1.5x its
added latency). This server keeps the subset of aiohttp's request/response surface the router uses, so the
handlers read the same:

- ``Request``: ``method``, ``path``, ``headers`` (case-insensitive), ``match_info``, ``read()``, ``json()``,
  and item access for per-request state;
- ``Response`` / ``json_response`` for whole answers; ``StreamResponse`` (``prepare``, ``write``,
  ``write_eof``) for Server-Sent Events, chunked, with backpressure from the client's socket.

What it does that a demanding client relies on: keep-alive and pipelining (answers in order), HTTP/1.0,
``Connection: close``, chunked request bodies, ``Expect: 100-continue`` (curl sends it for large bodies),
413 past the body limit, 431 past 64 KiB of headers, 400 with the parser's reason for bytes that are not
HTTP (and the connection closed; nothing else on the server is touched), 404/405, a 500 with no traceback
for a handler's bug, idle connections closed after ``keepalive_s``. A client that disconnects cancels its
handler, as aiohttp's ``handler_cancellation`` does, so the router can abort the request on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeAlias, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from actors.openai_api import error_body

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
MAX_PIPELINED = 8
"""Requests queued on one connection before reading from it pauses."""
INTERNAL_ERROR = "internal error in the router (logged)"


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _head(status: int, headers: Mapping[str, str]) -> list[bytes]:
    """Status line and headers, without the blank line that ends them."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status).encode())]
    lines.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
    return lines


class Request:
    """One parsed request (its whole body already read)."""

    __slots__ = ("_state", "body", "headers", "http10", "keep_alive", "match_info", "method", "path",
                 "query_string")

    def __init__(self, method: str, target: str, headers: CIMultiDictProxy[str], body: bytes,
                 keep_alive: bool, http10: bool = False) -> None:
        self.method = method
        path, _, self.query_string = target.partition("?")
        self.path = path
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http10 = http10
        self.match_info: dict[str, str] = {}
        self._state: dict[str, Any] = {}

    async def read(self) -> bytes:
        return self.body

    async def json(self) -> Any:
        return json.loads(self.body)

    def get(self, key: str, default: Any = None) -> Any:
        return self._state.get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        self._state[key] = value

    def __getitem__(self, key: str) -> Any:
        return self._state[key]


class Response:
    """A whole answer, sent with its length."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, *, body: bytes = b"", status: int = 200, headers: Mapping[str, str] | None = None,
                 content_type: str | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.body = body

    def encode(self, keep_alive: bool) -> bytes:
        lines = _head(self.status, self.headers)
        lines.append(b"Content-Length: %d\r\n" % len(self.body))
        if not keep_alive:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        lines.append(self.body)
        return b"".join(lines)


def json_response(data: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(body=json.dumps(data).encode(), status=status, headers=headers,
                    content_type="application/json; charset=utf-8")


def json_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """An error in OpenAI's shape, which the official client parses."""
    return json_response(error_body(status, message), status=status, headers=headers)


class StreamResponse:
    """An answer written as it is produced (Server-Sent Events): chunked, or for an HTTP/1.0 client raw
    bytes ended by closing the connection."""

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers or {})
        self.prepared = False
        self.finished = False
        self._chunked = True
        self._conn: _Connection | None = None

    async def prepare(self, request: Request) -> None:
        conn = request.get(_CONN_KEY)
        assert isinstance(conn, _Connection), "prepare() takes the request this answer is for"
        self._conn = conn
        self._chunked = not request.http10
        if not self._chunked:
            request.keep_alive = False  # no length and no chunks: the close ends the answer
        lines = _head(self.status, self.headers)
        lines.append(b"Transfer-Encoding: chunked\r\n\r\n" if self._chunked else b"Connection: close\r\n\r\n")
        self.prepared = True
        await conn.write(b"".join(lines))

    async def write(self, data: bytes) -> None:
        """Send ``data`` as one chunk; raises ``ConnectionResetError`` once the client is gone."""
        if not data:
            return
        assert self._conn is not None, "write() before prepare()"
        await self._conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    async def write_eof(self) -> None:
        if self._conn is not None and not self.finished:
            self.finished = True
            if self._chunked:
                await self._conn.write(b"0\r\n\r\n")


_CONN_KEY = "_kvmesh_connection"

Answer: TypeAlias = Response | StreamResponse
Handler: TypeAlias = Callable[[Request], Awaitable[Answer]]


class _Connection(asyncio.Protocol):
    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.busy = False
        self.last_active = time.monotonic()
        self._write_ready: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._rejected = False

    # -- asyncio.Protocol ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._rejected:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            if not self._rejected:
                self._reject(400, f"malformed HTTP request: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server._connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: its handler stops, and with it the engine's request
        w = self._write_ready
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        w = self._write_ready
        if w is not None and not w.done():
            w.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._reject(431, "request line and headers exceed 64 KiB")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > MAX_HEADER_BYTES:
            self._reject(431, "request line and headers exceed 64 KiB")
            return
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._rejected:
            return
        length = next((v for k, v in self._headers if k.lower() == "content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.server.max_body:
            self._reject(413, f"request body of {length} bytes exceeds the limit of {self.server.max_body}")
            return
        if any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in self._headers):
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_size += len(body)
        if self._body_size > self.server.max_body:
            self._reject(413, f"request body exceeds the limit of {self.server.max_body} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._rejected:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(self.parser.get_method().decode("ascii", "replace"), self._url.decode("latin-1"),
                      CIMultiDictProxy(CIMultiDict(self._headers)), body, self.parser.should_keep_alive(),
                      self.parser.get_http_version() == "1.0")
        req[_CONN_KEY] = self
        self.queue.append(req)
        if len(self.queue) >= MAX_PIPELINED and self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._serve())

    # -- serving ---------------------------------------------------------------------------------------------
    def _reject(self, status: int, message: str) -> None:
        """Answer an unparseable or oversized request and close: what follows on the socket is unknowable."""
        if self._rejected:
            return
        self._rejected = True
        if self.transport is not None and not self.closed:
            self.transport.write(json_error(status, message).encode(keep_alive=False))
            self.transport.close()

    async def write(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)
        w = self._write_ready
        if w is not None and not w.done():
            await w

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                req = self.queue.popleft()
                if self._reading_paused and len(self.queue) < MAX_PIPELINED // 2 and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
                self.busy = True
                resp = await self.server._dispatch(req)
                self.busy = False
                self.last_active = time.monotonic()
                if self.closed or self.transport is None:
                    return
                if isinstance(resp, StreamResponse) and resp.prepared:
                    if not resp.finished:
                        await resp.write_eof()
                elif isinstance(resp, StreamResponse):
                    log.error("handler for %s %s returned a stream it never began", req.method, req.path)
                    self.transport.write(json_error(500, INTERNAL_ERROR).encode(keep_alive=False))
                    self.transport.close()
                    return
                else:
                    self.transport.write(resp.encode(req.keep_alive))
                if not req.keep_alive:
                    self.transport.close()
                    return
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.busy = False
            self.task = None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


class HTTPServer:
    """Routes ``(method, path)`` to handlers; a path may end in ``{name}``, which fills ``match_info``."""

    def __init__(self, *, max_body: int, keepalive_s: float = 75.0) -> None:
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self._exact: dict[tuple[str, str], Handler] = {}
        self._prefixed: list[tuple[str, str, str, Handler]] = []
        self._paths: set[str] = set()
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def add(self, method: str, path: str, handler: Handler) -> None:
        if path.endswith("}") and "{" in path:
            prefix, _, name = path.rpartition("{")
            self._prefixed.append((method, prefix, name[:-1], handler))
            self._paths.add(prefix)
        else:
            self._exact[(method, path)] = handler
            self._paths.add(path)

    def _match(self, req: Request) -> Handler | bool | None:
        """The handler; False for a known path with another method; None for an unknown path."""
        h = self._exact.get((req.method, req.path))
        if h is not None:
            return h
        known = req.path in self._paths
        for method, prefix, name, handler in self._prefixed:
            rest = req.path[len(prefix):]
            if req.path.startswith(prefix) and rest and "/" not in rest:
                if method == req.method:
                    req.match_info[name] = rest
                    return handler
                known = True
        return False if known else None

    async def _dispatch(self, req: Request) -> Response | StreamResponse:
        handler = self._match(req)
        if handler is None:
            return json_error(404, f"no route for {req.path}")
        if handler is False:
            return json_error(405, f"{req.method} is not allowed on {req.path}")
        try:
            return await cast(Handler, handler)(req)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("handler for %s %s failed", req.method, req.path)
            return json_error(500, INTERNAL_ERROR)

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True)
        self._sweeper = loop.create_task(self._sweep_idle())
        return int(self._server.sockets[0].getsockname()[1])

    async def _sweep_idle(self) -> None:
        period = max(0.05, min(5.0, self.keepalive_s / 4))
        while True:
            await asyncio.sleep(period)
            cutoff = time.monotonic() - self.keepalive_s
            for c in list(self._connections):
                if not c.busy and not c.queue and c.last_active < cutoff:
                    c.close()

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            self._server.close()
            for c in list(self._connections):
                c.close()
                if c.task is not None:
                    c.task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
