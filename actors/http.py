"""Starting an aiohttp application on a host and port (0 picks a free one) and learning the port; running an
aiohttp write from code that is not a coroutine (``write_now``); running an awaitable to its first suspension and
something else before it waits (``first_step_then``)."""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Run ``app`` on ``host:port``; handlers are cancelled when their client disconnects."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    server = site._server
    assert server is not None
    return runner, int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]


def write_now(coro: Coroutine[Any, Any, None]) -> Awaitable[None] | BaseException | None:
    """Run an aiohttp write (``StreamResponse.write(data)``) here, to its end or its first suspension, as the task
    that awaits it would: None when it ended (a write while the transport takes more, the usual case, never
    waits), the exception it raised, or the rest of it when it must wait for the transport to drain: awaited by
    a task, that goes on from where it stopped (``go_on``), so aiohttp's own order of writes, errors and
    cancellation hold. Lets a caller that is not a coroutine write at once, without waking a task per write."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    except Exception as e:
        return e
    return go_on(coro, waiting)


def _nothing() -> None:
    """No work after the first step (``first_step_then``'s default)."""


def first_step_then(awaitable: Awaitable[T], then: Callable[[], None] = _nothing) -> Awaitable[T]:
    """Run ``awaitable`` here to its first suspension, then call ``then``; the rest goes on in the task that awaits
    what this returns (``go_on``), or, where the first step ended, an awaitable of its value. ``then`` runs before
    any other task can, so for the rest of the program it is as if it had run first; it is called whether the
    first step suspended, ended or raised (then before the error goes on). What it serves: work that must precede
    the next decision but not the bytes an awaitable sends in its first step (the router's bookkeeping of a
    request it has just written to an engine); without ``then``, starting a coroutine eagerly (an aiohttp body
    write, ``cluster.router.upstream._EagerBodyRequest``)."""
    it = awaitable.__await__()
    try:
        waiting = it.send(None)
    except StopIteration as stop:
        then()
        return _ended(stop.value)
    except BaseException:
        then()
        raise
    try:
        then()
    except BaseException:
        it.close()
        raise
    return go_on(it, waiting)


async def _ended(value: T) -> T:
    return value


@types.coroutine
def go_on(coro: Coroutine[Any, Any, T] | Generator[Any, None, T], waiting: Any) -> Generator[Any, None, T]:
    """Drive ``coro`` on from where it first suspended (awaiting ``waiting``), as its task would have: each
    future it awaits is handed to the task running this, and what the task sends or throws back goes into it;
    its value is this one's."""
    while True:
        try:
            yield waiting
        except BaseException as e:  # (cancellation among them: ``coro`` handles it as aiohttp wrote it to)
            try:
                waiting = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waiting = coro.send(None)
            except StopIteration as stop:
                return stop.value
