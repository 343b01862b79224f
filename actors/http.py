"""Starting an aiohttp application on a host and port (0 picks a free one) and learning the port; running an
aiohttp write from code that is not a coroutine (``write_now``)."""

from __future__ import annotations

import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any

from aiohttp import web


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


@types.coroutine
def go_on(coro: Coroutine[Any, Any, None], waiting: Any) -> Generator[Any, None, None]:
    """Drive ``coro`` on from where it first suspended (awaiting ``waiting``), as its task would have: each
    future it awaits is handed to the task running this, and what the task sends or throws back goes into it."""
    while True:
        try:
            yield waiting
        except BaseException as e:  # (cancellation among them: ``coro`` handles it as aiohttp wrote it to)
            try:
                waiting = coro.throw(e)
            except StopIteration:
                return
        else:
            try:
                waiting = coro.send(None)
            except StopIteration:
                return
