"""Warm connections: the router opens its pool to every engine ahead of the first request (no Ray, no
sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self

from cluster.router.app import WARM_CONNECTIONS, RouterServer
from cluster.router.exchange import Call
from cluster.router.upstream import AiohttpUpstream, UpstreamError
from tests.unit.router.conftest import workers
from tests.unit.router.fakes import FakeUpstream

MakeRouter = Callable[..., Awaitable[RouterServer]]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_every_engine_is_warmed_at_start_and_one_that_joins_when_it_joins(
        make_router: MakeRouter, upstream: FakeUpstream) -> None:
    ws = workers(3)
    upstream.down.add(ws[2].url)  # not up yet: warming it fails quietly
    r = await make_router(ws)
    await settle()
    assert sorted(upstream.warmed) == [(w.url, WARM_CONNECTIONS) for w in ws]
    assert all(w.breaker.state == "closed" for w in ws)  # a warm-up is no attempt: no breaker counts it
    assert not upstream.sent  # and no request reached an engine's API
    answer = await r.add_worker(Call("/workers", {}, json.dumps({"name": "w9", "url": "http://w9"}).encode()))
    assert answer.status == 200
    await settle()
    assert upstream.warmed[-1] == ("http://w9", WARM_CONNECTIONS)


class _Resp:
    def __init__(self) -> None:
        self.read_to_end = False

    async def read(self) -> bytes:
        self.read_to_end = True
        return b""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        pass


class _Scripted(AiohttpUpstream):
    """``AiohttpUpstream.warm`` over scripted ``request`` outcomes (the aiohttp session is never opened)."""

    def __init__(self, fail_after: int) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, str]] = []
        self.answers: list[_Resp] = []
        self.fail_after = fail_after

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",  # type: ignore[override]
                      headers: object = None) -> _Resp:
        self.calls.append((method, base_url, path))
        refused = len(self.calls) > self.fail_after
        await asyncio.sleep(0)
        if refused:
            raise UpstreamError("connection refused")
        resp = _Resp()
        self.answers.append(resp)
        return resp


async def test_warm_reads_each_answer_to_its_end_and_counts_failures_without_raising() -> None:
    up = _Scripted(fail_after=2)
    assert await up.warm("http://e", 3) == 2
    assert up.calls == [("GET", "http://e", "/health")] * 3
    assert all(r.read_to_end for r in up.answers)  # read to its end: the connection stays in the pool
