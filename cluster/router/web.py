"""The router's HTTP server: aiohttp, adapted to the mechanism's ``Call`` / ``Whole`` / ``ClientStream``.

aiohttp's server as the engines use it (``actors.http.serve_app``): its C parser (llhttp), no access log,
keep-alive, a 400 for bytes that are not HTTP (that connection closed, nothing else touched), 413 past
``MAX_BODY_BYTES``, HEAD served for every GET, and handlers cancelled when their client disconnects
(``handler_cancellation``), which is how a client that leaves aborts the engine's request: the cancellation
closes the upstream connection. Streams are ``StreamResponse`` writes, chunked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from actors.http import serve_app
from actors.openai_api import MAX_BODY_BYTES
from cluster.router.app import RouterServer
from cluster.router.exchange import Call, ClientStream, Whole, json_error

log = logging.getLogger(__name__)

WholeHandler = Callable[[Call], Awaitable[Whole]]
StreamHandler = Callable[[Call, ClientStream], Awaitable[Whole | None]]


class WebStream:
    """:class:`ClientStream` over an aiohttp ``StreamResponse``, begun on ``start``."""

    __slots__ = ("request", "response")

    def __init__(self, request: web.Request) -> None:
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


def _too_large(request: web.Request) -> web.Response | None:
    """A declared body over the limit is refused before it is read (aiohttp would first wait for it)."""
    n = request.content_length
    if n is not None and n > MAX_BODY_BYTES:
        return _whole(json_error(413, f"request body of {n} bytes exceeds the limit of {MAX_BODY_BYTES}"))
    return None


def whole_handler(fn: WholeHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        refused = _too_large(request)
        if refused is not None:
            return refused
        body = await request.read() if request.can_read_body else b""
        return _whole(await fn(Call(request.path, request.headers, body, request.match_info)))
    return handle


def stream_handler(fn: StreamHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        refused = _too_large(request)
        if refused is not None:
            return refused
        body = await request.read()
        out = WebStream(request)
        answer = await fn(Call(request.path, request.headers, body, request.match_info), out)
        if out.response is None:
            if answer is None:
                log.error("handler for %s %s streamed nothing", request.method, request.path)
                answer = json_error(500, "internal error in the router (logged)")
            return _whole(answer)
        with contextlib.suppress(ConnectionResetError):
            await out.response.write_eof()
        return out.response
    return handle


def router_app(server: RouterServer) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/completions", stream_handler(server.completions))
    app.router.add_post("/v1/chat/completions", stream_handler(server.chat_completions))
    app.router.add_get("/v1/models", whole_handler(server.models))
    app.router.add_get("/health", whole_handler(server.health))
    app.router.add_get("/metrics", whole_handler(server.prometheus))
    app.router.add_get("/workers", whole_handler(server.list_workers))
    app.router.add_post("/workers", whole_handler(server.add_worker))
    app.router.add_delete("/workers/{name}", whole_handler(server.remove_worker))
    return app


class RouterHTTP:
    """A :class:`RouterServer` served over HTTP: start the mechanism, then aiohttp's server."""

    def __init__(self, server: RouterServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        await self.server.start_mechanism()
        self._runner, self.port = await serve_app(router_app(self.server), self.host, self.port)
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.server.stop_mechanism()
