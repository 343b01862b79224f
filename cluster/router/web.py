"""The router's HTTP server: aiohttp's low-level server, adapted to the mechanism's ``Call`` / ``Whole`` /
``ClientStream``.

aiohttp's ``web_server.Server`` (its ``RequestHandler`` protocol, without the application layer: the router
dispatches on a dict of ``(method, path)``): its C parser (llhttp), no access log, keep-alive, a 400 for bytes
that are not HTTP (that connection closed, nothing else touched), 413 past ``MAX_BODY_BYTES`` (refused on a
declared length before the body is read), ``Expect: 100-continue`` answered, HEAD served for every GET, and
handlers cancelled when their client disconnects (``handler_cancellation``), which is how a client that leaves
aborts the engine's request: the cancellation closes the upstream connection. Streams are ``StreamResponse``
writes, chunked.

Why the low-level server: the application layer (URL dispatcher, middleware chain, ``Request`` wrapping) cost
about 4% of the router's CPU per request in a cProfile of ``bench/router.py``'s request shape, for routing
that is eight fixed paths here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web, web_server
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion11
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from actors.openai_api import MAX_BODY_BYTES
from cluster.router.app import RouterServer
from cluster.router.exchange import Call, ClientStream, Whole, json_error

log = logging.getLogger(__name__)

WholeHandler = Callable[[Call], Awaitable[Whole]]
StreamHandler = Callable[[Call, ClientStream], Awaitable[Whole | None]]
Route = Callable[[web.BaseRequest, Mapping[str, str]], Awaitable[web.StreamResponse]]


class WebStream:
    """:class:`ClientStream` over an aiohttp ``StreamResponse``, begun on ``start``."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.BaseRequest) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start(self, headers: Mapping[str, str]) -> None:
        resp = web.StreamResponse(status=200, headers=headers)
        self.response = resp
        await resp.prepare(self.request)

    async def write(self, data: bytes) -> None:
        assert self.response is not None, "write() before start()"
        await self.response.write(data)


def _whole(answer: Whole) -> web.Response:
    return web.Response(body=answer.body, status=answer.status, headers=answer.headers)


def _too_large(request: web.BaseRequest) -> web.Response | None:
    """A declared body over the limit is refused before it is read (aiohttp would first wait for it)."""
    n = request.content_length
    if n is not None and n > MAX_BODY_BYTES:
        return _whole(json_error(413, f"request body of {n} bytes exceeds the limit of {MAX_BODY_BYTES}"))
    return None


def whole_route(fn: WholeHandler) -> Route:
    async def handle(request: web.BaseRequest, match: Mapping[str, str]) -> web.StreamResponse:
        refused = _too_large(request)
        if refused is not None:
            return refused
        body = await request.read() if request.can_read_body else b""
        return _whole(await fn(Call(request.path, request.headers, body, match)))
    return handle


def stream_route(fn: StreamHandler) -> Route:
    async def handle(request: web.BaseRequest, match: Mapping[str, str]) -> web.StreamResponse:
        refused = _too_large(request)
        if refused is not None:
            return refused
        n = request.content_length
        try:
            body = await request.content.readexactly(n) if n else await request.read()
        except asyncio.IncompleteReadError:
            return _whole(json_error(400, f"the request body ended before its {n} bytes"))
        out = WebStream(request)
        answer = await fn(Call(request.path, request.headers, body, match), out)
        if out.response is None:
            if answer is None:
                log.error("handler for %s %s streamed nothing", request.method, request.path)
                answer = json_error(500, "internal error in the router (logged)")
            return _whole(answer)
        with contextlib.suppress(ConnectionResetError):
            await out.response.write_eof()
        return out.response
    return handle


class Dispatch:
    """``(method, path)`` to a route; a path prefix ending in ``/`` takes the rest as ``{name}``; every GET is
    also served for HEAD (aiohttp leaves the body out); 404 for an unknown path, 405 for a known one with
    another method."""

    def __init__(self) -> None:
        self.exact: dict[tuple[str, str], Route] = {}
        self.prefixed: dict[tuple[str, str], Route] = {}

    def add(self, method: str, path: str, route: Route) -> None:
        table = self.prefixed if path.endswith("/") else self.exact
        table[(method, path)] = route
        if method == "GET":
            table[("HEAD", path)] = route

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get("Expect")
        if expect is not None:
            # What aiohttp's application layer does for curl's large uploads: go on, send the body.
            if expect.lower() != "100-continue" or request.version != HttpVersion11:
                return _whole(json_error(417, f"unsupported Expect: {expect}"))
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        path = request.path
        route = self.exact.get((request.method, path))
        if route is not None:
            return await route(request, {})
        head, _, rest = path.rpartition("/")
        route = self.prefixed.get((request.method, head + "/"))
        if route is not None and rest:
            return await route(request, {"name": rest})
        known = any(p == path for _, p in self.exact) or any(p == head + "/" for _, p in self.prefixed)
        if known:
            return _whole(json_error(405, f"{request.method} is not allowed on {path}"))
        return _whole(json_error(404, f"no route for {path}"))


def router_dispatch(server: RouterServer) -> Dispatch:
    d = Dispatch()
    d.add("POST", "/v1/completions", stream_route(server.completions))
    d.add("POST", "/v1/chat/completions", stream_route(server.chat_completions))
    d.add("GET", "/v1/models", whole_route(server.models))
    d.add("GET", "/health", whole_route(server.health))
    d.add("GET", "/metrics", whole_route(server.prometheus))
    d.add("GET", "/workers", whole_route(server.list_workers))
    d.add("POST", "/workers", whole_route(server.add_worker))
    d.add("DELETE", "/workers/", whole_route(server.remove_worker))
    return d


class RouterHTTP:
    """A :class:`RouterServer` served over HTTP: start the mechanism, then aiohttp's low-level server."""

    def __init__(self, server: RouterServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.url = ""
        self._runner: web.ServerRunner | None = None

    @staticmethod
    def _request(message: RawRequestMessage, payload: StreamReader, protocol: RequestHandler,
                 writer: AbstractStreamWriter, task: asyncio.Task[None]) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop(),
                               client_max_size=MAX_BODY_BYTES)

    async def start(self) -> str:
        await self.server.start_mechanism()
        kwargs: dict[str, Any] = {"access_log": None}
        lowlevel = web_server.Server(router_dispatch(self.server), request_factory=self._request,
                                     handler_cancellation=True, **kwargs)
        self._runner = web.ServerRunner(lowlevel, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.port = int(sock.getsockname()[1])
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.server.stop_mechanism()
