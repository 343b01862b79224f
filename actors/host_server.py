"""One HTTP server for every engine of a process: engines addressed by path, ``/e/<engine>/...``.

Each engine keeps its own ``EngineServer`` (its handlers, draining flag, in-flight count, metrics); this
server mounts each one's application under ``/e/<engine>`` on a single aiohttp runner and port, so an
engine's URL is ``http://host:port/e/<engine>`` and every path a client appends to it (``/v1/completions``,
``/health``, ``/metrics``, ``/kvmesh/reserve``) works as on a server of its own. The process's feed (every
engine on it) is served at the root, ``/kvmesh/feed``, with ``/health`` for the process itself.

Why by path and not by port: one listening socket and one connection pool per router for the whole
process; aiohttp resolves a prefixed sub-application with a dictionary lookup per path level, so the
cost per request does not grow with the number of engines (``bench/density.py`` measures both layouts).

Killing one engine (fault injection, ``kill``) must look to its clients as a dead process would, while
the other engines of the process go on: the connections of its open requests are dropped (their handlers
are cancelled, which aborts the requests in the engine), its feed says ``gone``, its engine and KV
transport stop, and any later request to it loses its connection before an answer. A middleware keeps,
per engine, the requests being answered, which is what makes the first step possible.

Invariants: an engine name is mounted at most once; engines are mounted before ``start`` (aiohttp freezes
the routing table then); a killed engine is never served again by this process.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from actors.feed import FeedHub
from actors.http import serve_app
from actors.openai_api import MAX_BODY_BYTES
from actors.server import EngineServer

PREFIX = "/e/"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def engine_of_path(path: str) -> str | None:
    """The engine a request path addresses (``/e/<engine>/...``), None for the process's own paths."""
    if not path.startswith(PREFIX):
        return None
    return path[len(PREFIX):].split("/", 1)[0] or None


class HostServer:
    """Serves several engines of one process on one port (see the module docstring)."""

    def __init__(self, hub: FeedHub, host: str = "127.0.0.1", port: int = 0) -> None:
        self.hub = hub
        self.host = host
        self.port = port
        self.url = ""
        self.servers: dict[str, EngineServer] = {}
        self.dead: set[str] = set()
        self._open: dict[str, dict[int, web.Request]] = {}
        """Per engine, the requests being answered, by id (aiohttp requests are not hashable)."""
        self._runner: web.AppRunner | None = None

    def mount(self, name: str, server: EngineServer) -> None:
        """Serve ``server`` under ``/e/<name>`` (before ``start``)."""
        if self._runner is not None:
            raise RuntimeError("engines must be mounted before the host server starts")
        if name in self.servers or "/" in name or not name:
            raise ValueError(f"engine name {name!r} is empty, has a '/' or is mounted already")
        self.servers[name] = server
        self._open[name] = {}

    def engine_url(self, name: str) -> str:
        return f"{self.url}{PREFIX}{name}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._track])
        app.router.add_get("/health", self._health)
        app.router.add_get("/kvmesh/feed", self._feed)
        for name, server in self.servers.items():
            app.add_subapp(f"{PREFIX}{name}", server.app())
        return app

    async def start(self) -> str:
        """Listen; every mounted engine's ``url`` is set to its prefixed URL. Returns the process's URL."""
        self._runner, self.port = await serve_app(self.app(), self.host, self.port)
        self.url = f"http://{self.host}:{self.port}"
        for name, server in self.servers.items():
            server.url = self.engine_url(name)
            server.port = self.port
        return self.url

    async def stop(self) -> None:
        for server in self.servers.values():
            await server.stop()  # no runner of its own: takes its engine off the feed
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def kill(self, name: str) -> list[web.Request]:
        """Cut ``name`` off as if its process died: drop its open requests' connections, refuse new ones.

        The caller stops the engine and its KV transport. Returns the requests whose connections were dropped.
        """
        if name not in self.servers:
            raise KeyError(f"no engine {name!r} on this server")
        self.dead.add(name)
        self.hub.remove(name)
        dropped = list(self._open.get(name, {}).values())
        for request in dropped:
            if request.transport is not None:
                request.transport.close()
        return dropped

    # -- handlers ------------------------------------------------------------------------------------
    @web.middleware
    async def _track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        name = engine_of_path(request.path)
        if name is None or name not in self._open:
            return await handler(request)
        if name in self.dead:
            if request.transport is not None:
                request.transport.close()  # as a dead process: the connection goes, no answer
            return web.Response(status=503)
        open_ = self._open[name]
        open_[id(request)] = request
        try:
            return await handler(request)
        finally:
            open_.pop(id(request), None)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _feed(self, request: web.Request) -> web.WebSocketResponse:
        return await self.hub.serve(request)
