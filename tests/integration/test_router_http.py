"""The router's HTTP behaviour over real sockets (aiohttp on both sides), with small aiohttp engines standing
in for kvmesh's (no Ray): malformed requests, stalled engines, client disconnects, HEAD, keep-alive."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from actors.http import serve_app
from cluster.router.app import RouterServer
from cluster.router.view import WorkerId, WorkerInfo
from cluster.router.web import RouterHTTP
from config.cluster import RouterSpec

pytestmark = pytest.mark.integration


def chunk(rid: str, t: int, finish: bool) -> bytes:
    obj = {"id": rid, "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": f"t{t} ", "logprobs": None, "finish_reason": "length" if finish else None,
                        "stop_reason": None, "token_ids": [t]}]}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Engine:
    """An OpenAI-ish engine: ``tokens`` tokens ``gap_s`` apart; ``stall`` makes it go silent instead, ``stall_after``
    after that many tokens of its first streamed answer."""

    def __init__(self, name: str, *, stall: bool = False, gap_s: float = 0.0, tokens: int = 3,
                 stall_after: int | None = None) -> None:
        self.name = name
        self.stall = stall
        self.stall_after = stall_after
        self.gap_s = gap_s
        self.tokens = tokens
        self.received = 0
        self.aborted = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received += 1
        try:
            if self.stall:
                await asyncio.sleep(3600)
            if not body.get("stream"):
                return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                          "choices": [{"index": 0, "text": self.name, "finish_reason": "length"}],
                                          "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body.get("max_tokens", self.tokens))
            for k in range(n):
                if k == self.stall_after and self.received == 1:
                    await asyncio.sleep(3600)
                await asyncio.sleep(self.gap_s)
                await resp.write(chunk(f"cmpl-{self.name}", 100 + k, k == n - 1))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self._runner, port = await serve_app(app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


Start = Callable[..., Awaitable[tuple[str, list[Engine]]]]


@pytest.fixture
async def router_over() -> AsyncIterator[Start]:
    """A real router (aiohttp server and client) over the given engines; everything stopped afterwards, and
    nothing left behind: no request counted in flight on a worker, no deadline tracked, no engine connection
    in use, no task running."""
    started: list[Any] = []
    servers: list[RouterServer] = []

    async def start(engines: list[Engine], **spec: Any) -> tuple[str, list[Engine]]:
        for e in engines:
            await e.start()
            started.append(e)
        ws = [WorkerInfo(WorkerId(e.name), e.url, model="m") for e in engines]
        server = RouterServer(ws, RouterSpec(index_mode="approximate", policy="round_robin", **spec),
                              prefill_ms=lambda w, new, cached: 0.0)
        http = RouterHTTP(server)
        url = await http.start()
        started.append(http)
        servers.append(server)
        return url, engines

    yield start
    for server in servers:
        for _ in range(100):  # a handler cancelled by a disconnect finishes on the next loop turns
            if all(w.inflight == 0 for w in server.view.workers.values()) and not server.deadlines.tracked:
                break
            await asyncio.sleep(0.01)
        assert {w.name: w.inflight for w in server.view.workers.values() if w.inflight} == {}
        assert server.deadlines.tracked == 0
        session = getattr(server.upstream, "_session", None)
        if session is not None:
            assert not session.connector._acquired, "an engine connection is still in use"
    for s in reversed(started):
        await s.stop()
    await asyncio.sleep(0)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not leftover, f"tasks left behind: {leftover}"


async def read_stream(resp: aiohttp.ClientResponse) -> list[int]:
    ids = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            ids += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids") or []]
    return ids


async def test_a_malformed_request_gets_a_400_and_other_connections_are_unaffected(router_over: Start) -> None:
    url, _ = await router_over([Engine("a", gap_s=0.05, tokens=6)])
    host, port = url.removeprefix("http://").split(":")
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 6, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as streaming:
            assert streaming.status == 200
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n{}")
            status_line = await reader.readline()
            assert status_line.split()[1] == b"400", status_line
            writer.close()
            assert await read_stream(streaming) == [100, 101, 102, 103, 104, 105]
        async with s.post(url + "/v1/completions", data=b"{not json") as bad:
            assert bad.status == 400 and "JSON" in (await bad.json())["error"]["message"]
        async with s.head(url + "/v1/models") as head:
            assert head.status == 200
    # curl's upload of a large body: the head, a wait for "100 Continue", then the body.
    body_bytes = json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 2}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body_bytes))
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
    writer.write(body_bytes)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.split(b" ", 2)[1] == b"200" and b'"text": "a"' in answer


async def test_a_stalled_engine_is_given_up_on_after_the_read_timeout_and_the_request_retried_elsewhere(
        router_over: Start) -> None:
    url, (stalled, healthy) = await router_over([Engine("a", stall=True), Engine("b")], read_timeout_s=0.3)
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                   json={"model": "m", "prompt": [1, 2]}) as r:
        assert r.status == 200 and r.headers["X-Served-By"] == "b"
        assert (await r.json())["choices"][0]["text"] == "b"
    assert stalled.received == 1 and healthy.received == 1
    await asyncio.sleep(0.05)
    assert stalled.aborted == 1  # the router closed the stalled engine's connection


async def test_an_engine_silent_mid_stream_is_given_up_on_after_the_read_timeout_and_the_stream_goes_on_elsewhere(
        router_over: Start) -> None:
    url, (stalled, healthy) = await router_over([Engine("a", stall_after=2), Engine("b")], read_timeout_s=0.3)
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 5, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["X-Served-By"] == "a"
            text = (await asyncio.wait_for(r.read(), 30)).decode()
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 5 and ids[:2] == [100, 101] and text.endswith("data: [DONE]\n\n")
    assert stalled.received == 1 and healthy.received == 1  # b finished what a left silent
    for _ in range(100):
        if stalled.aborted:
            break
        await asyncio.sleep(0.02)
    assert stalled.aborted == 1  # the router closed the silent engine's connection


async def test_a_client_disconnect_aborts_the_engines_request(router_over: Start) -> None:
    url, (engine,) = await router_over([Engine("a", gap_s=0.05, tokens=200)])
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 200, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()
        # Leaving the block before the end closes the connection: the client is gone.
    for _ in range(100):
        if engine.aborted:
            break
        await asyncio.sleep(0.02)
    assert engine.aborted == 1
