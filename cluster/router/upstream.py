"""The router's client to its engines: one interface (``Upstream``), an aiohttp implementation, one error.

The mechanism (attempts, relay, P/D flow) sees only :class:`Upstream` and :class:`UpstreamResponse`, so its
unit tests drive it with fake engines (no sockets); production uses :class:`AiohttpUpstream`.

Semantics the router relies on:
- ``request`` returns once the answer's status and headers arrived; the body follows chunk by chunk
  (``chunk`` returns the bytes as they came, ``b""`` at the end);
- leaving ``async with`` before the body ended, or cancelling, closes the connection: the engine sees its
  client go and aborts the request (what a client disconnect or a router deadline must do); an answer
  read to its end leaves the connection in the pool, kept alive;
- a stream whose ``[DONE]`` the router has relayed is ``drain``-ed before it is left: the engine writes its
  ``[DONE]`` event and its chunked body's end in two writes (``actors/server.py``), so the router often sees
  the event first; closing then would drop a connection the engine had finished with, and the next request to
  that engine would pay a fresh connect (200 streamed requests on 4 warm connections: 36 connections opened
  without the drain, 4 with it; a connect costs ~2 ms wall more than a pooled send, ``bench/router_miss``);
- every failure (connect, connect timeout, an engine silent past the read timeout, a broken connection,
  bytes that are not HTTP) raises :class:`UpstreamError` and nothing else: ``_mapped`` is the one place
  that maps aiohttp's and the OS's errors into it, so the router tells an engine's failure from its own
  client's disconnect (``ConnectionResetError`` on the client side).

aiohttp tuning (what its client offers): one shared ``ClientSession`` for the router's life; a
``TCPConnector`` sized by ``connections`` (a quarter of them per engine), keep-alive of 30 s (below the
engines' aiohttp server's 75 s, so the engine never closes a connection the router is about to reuse),
DNS cached, each engine's pool opened ahead of its first request (``warm``; kept for those 30 s);
``ClientTimeout`` with ``sock_connect`` (a pool wait is not an engine failure, so ``connect``, which would
count it, is unset) and ``sock_read`` (the read timeout: the longest silence between two
reads); no decompression, no cookie jar (an engine's cookie is no business of the next request), no default
``User-Agent``/``Accept``/``Accept-Encoding`` headers; bodies are sent
as prepared bytes (no JSON re-encoding), read with ``content.readany()`` as they arrive; each engine URL is parsed
once (``yarl.URL``); the body is written as the request is sent (``_EagerBodyRequest``), not a loop pass later.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from yarl import URL

from actors.http import first_step_then


class UpstreamError(Exception):
    """The engine could not be reached, its connection failed or stalled, or its answer was not valid HTTP."""


class UpstreamResponse(Protocol):
    status: int
    headers: Mapping[str, str]

    async def chunk(self) -> bytes:
        """The next body bytes as they arrived (``b""`` at the end); raises :class:`UpstreamError`."""
        ...

    async def read(self) -> bytes:
        """The rest of the body; raises :class:`UpstreamError`."""
        ...

    async def drain(self, wait_s: float = 0.05) -> bool:
        """The answer is complete (its ``[DONE]`` relayed): read what is left of the body, its end normally in
        flight already, for at most ``wait_s`` wall seconds, so ``close`` keeps the connection; whether the body
        ended. Never raises."""
        ...

    def close(self) -> None:
        """Done: the connection is kept if the body was read to its end, else closed (aborting the request)."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None: ...


class Upstream(Protocol):
    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None,
                      sent: Callable[[], None] | None = None) -> UpstreamResponse:
        """Send one request; return once the answer's status and headers arrived. ``sent`` is called once, before
        any other task runs, as soon as the request is on its way (written to a pooled connection, or waiting for
        a connection, or failed): what the caller must do before the next decision but not before the engine
        has the request (its bookkeeping) then runs while the engine works."""
        ...

    async def warm(self, base_url: str, connections: int) -> int:
        """Open up to ``connections`` kept-alive connections to an engine ahead of its first request; how many
        answered. Never raises: an engine that is not up yet is simply not warmed."""
        ...

    async def close(self) -> None: ...


async def post_json(upstream: Upstream, base_url: str, path: str, body: Any,
                    headers: Mapping[str, str] | None = None) -> UpstreamResponse:
    return await upstream.request("POST", base_url, path, json.dumps(body).encode(),
                                  {"Content-Type": "application/json", **(headers or {})})


async def read_json(resp: UpstreamResponse) -> Any:
    data = await resp.read()
    try:
        return json.loads(data)
    except ValueError as e:
        raise UpstreamError(f"the engine's answer is not JSON: {e}") from None


def _mapped(e: BaseException) -> UpstreamError:
    """The one place where transport failures become :class:`UpstreamError`."""
    if isinstance(e, aiohttp.ServerTimeoutError | TimeoutError):
        return UpstreamError(f"the engine was silent past the read timeout ({type(e).__name__}: {e})")
    return UpstreamError(f"{type(e).__name__}: {e}")


_FAILURES = (aiohttp.ClientError, TimeoutError, OSError, ValueError)
_MAX_URLS = 4096


class AiohttpResponse:
    """:class:`UpstreamResponse` over an aiohttp ``ClientResponse``."""

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def chunk(self) -> bytes:
        try:
            return await self._resp.content.readany()
        except _FAILURES as e:
            raise _mapped(e) from None

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except _FAILURES as e:
            raise _mapped(e) from None

    async def drain(self, wait_s: float = 0.05) -> bool:
        content = self._resp.content
        if content.is_eof():
            return True
        try:
            async with asyncio.timeout(wait_s):
                while await content.readany():
                    pass  # (bytes after [DONE]: nothing the client is owed)
        except _FAILURES:  # (TimeoutError among them) the engine kept its stream open: close() drops it
            return False
        return content.is_eof()

    def close(self) -> None:
        if self._resp.content.is_eof():
            self._resp.release()  # read to its end: the connection goes back to the pool
        else:
            self._resp.close()  # abandoned mid-answer: the engine sees the connection go

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()


class _EagerBodyRequest(aiohttp.ClientRequest):
    """aiohttp's request, its body written as ``send`` hands it over rather than a loop pass later.

    ``send`` buffers the request's headers, then runs ``write_bytes`` (the body, coalesced with the headers into
    one write, the end of the message, the read timeout) as a task of its own. From Python 3.12 that task starts
    eagerly; before (3.11 here) it starts on the next pass of the loop, after ``send`` returned and the response
    reader began waiting: the engine sees the request that much later (``AiohttpUpstream.request`` to the handler
    of one of ``bench/router_miss``'s engines, 330 streamed requests a round, three rounds alternated on a
    contended host: medians 401/344/337 -> 337/326/295 us wall, the same CPU). This does what
    3.12 does: ``write_bytes`` runs here to its first suspension, which for a body of bytes under the transport's
    limit is its end (the task then runs an empty coroutine); a body that must wait for the transport to drain
    goes on in the task from where it stopped (``actors.http.first_step_then``), so errors, cancellation and the
    order of writes are aiohttp's own."""

    if sys.version_info < (3, 12):
        def write_bytes(self, writer: AbstractStreamWriter, conn: Any,
                        *args: Any) -> Coroutine[Any, Any, None]:
            # (``*args``: aiohttp 3.9-3.10 pass (writer, conn), later releases also the content length)
            return first_step_then(super().write_bytes(writer, conn, *args))  # type: ignore[return-value]


@dataclass(frozen=True)
class UpstreamLimits:
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = 600.0
    """Wall seconds of engine silence tolerated mid-answer (None: no limit)."""
    connections: int = 4096
    keepalive_s: float = 30.0


class AiohttpUpstream:
    """:class:`Upstream` over one shared aiohttp ``ClientSession`` (see the module docstring for the tuning)."""

    def __init__(self, limits: UpstreamLimits | None = None) -> None:
        self.limits = limits or UpstreamLimits()
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}
        """Each engine endpoint's URL, parsed once (a handful: engines x paths; cleared past ``_MAX_URLS``)."""

    def _open(self) -> aiohttp.ClientSession:
        lim = self.limits
        connector = aiohttp.TCPConnector(limit=lim.connections, limit_per_host=max(1, lim.connections // 4),
                                         keepalive_timeout=lim.keepalive_s, use_dns_cache=True, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=lim.connect_timeout_s,
                                        sock_read=lim.read_timeout_s)
        return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
                                     cookie_jar=aiohttp.DummyCookieJar(), request_class=_EagerBodyRequest)

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None,
                      sent: Callable[[], None] | None = None) -> AiohttpResponse:
        if self._session is None:
            self._session = self._open()
        text = base_url + path
        url = self._urls.get(text)
        try:
            try:
                if url is None:
                    if len(self._urls) >= _MAX_URLS:
                        self._urls.clear()
                    url = self._urls[text] = URL(text)
                pending = self._session.request(method, url, data=body or None, headers=headers)
            except BaseException:
                if sent is not None:
                    sent()
                raise
            # With ``sent``: the request is built and, on a pooled connection, written here (``_EagerBodyRequest``)
            # before ``sent`` runs; the wait for the answer's headers goes on in this task.
            resp = await (pending if sent is None else first_step_then(pending, sent))
        except _FAILURES as e:
            raise _mapped(e) from None
        return AiohttpResponse(resp)

    async def warm(self, base_url: str, connections: int) -> int:
        """``GET /health`` on ``connections`` connections at once, each read to its end so it stays in the
        pool: the first requests to the engine then skip the connect (2.35 ms from the router's send to the
        engine's handler on a fresh connection, 0.39 ms on a pooled one, in ``bench/router_miss``'s cold
        phase), as sgl-router's start-up health checks leave its pool warm."""

        async def one() -> bool:
            try:
                async with await self.request("GET", base_url, "/health") as resp:
                    await resp.read()
                    return True
            except UpstreamError:
                return False

        return sum(await asyncio.gather(*(one() for _ in range(connections))))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
