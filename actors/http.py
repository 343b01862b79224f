"""Starting an aiohttp application on a host and port (0 picks a free one) and learning the port."""

from __future__ import annotations

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
