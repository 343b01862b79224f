"""The router's HTTP/1.1 client, protocol only: bytes in through a transport that records what it is told."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.upstream import READ_HIGH_WATER, UpstreamError, UpstreamPool, _Connection


class FakeTransport(asyncio.Transport):
    def __init__(self, conn: _Connection) -> None:
        super().__init__()
        self.conn = conn
        self.sent: list[bytes] = []
        self.paused = False
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent.append(bytes(data))

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self.conn.connection_lost(None)

    def is_closing(self) -> bool:
        return self.aborted


class FakePool(UpstreamPool):
    """Connections whose transports the test drives; ``made`` lists them in order."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[FakeTransport] = []

    async def _connect(self, key: tuple[str, int]) -> _Connection:
        conn = _Connection(self, key)
        t = FakeTransport(conn)
        conn.connection_made(t)
        self.made.append(t)
        return conn


def answer(body: bytes, *, chunked: bool = False, close: bool = False, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: text/event-stream\r\n".encode()
    if close:
        head += b"Connection: close\r\n"
    if chunked:
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:7], body[7:]) if c) + b"0\r\n\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


async def start(pool: FakePool, **kw: Any) -> asyncio.Task[Any]:
    task = asyncio.create_task(pool.post("http://127.0.0.1:9", "/v1/completions", b'{"a":1}', **kw))
    await asyncio.sleep(0)
    return task


def feed(t: FakeTransport, data: bytes, cuts: list[int] | None = None) -> None:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in (cuts or []))})
    for a, b in itertools.pairwise(points):
        t.conn.data_received(data[a:b])


async def test_one_write_per_request_and_a_kept_alive_connection_is_reused() -> None:
    pool = FakePool()
    task = await start(pool, headers={"X-Request-Id": "r1"})
    t = pool.made[0]
    assert len(t.sent) == 1
    head, _, body = t.sent[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:9\r\n")
    assert b"Content-Length: 7" in head and b"X-Request-Id: r1" in head and body == b'{"a":1}'
    feed(t, answer(b"hello"))
    async with await task as r:
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
        assert await r.read() == b"hello"
    task = await start(pool)
    assert len(pool.made) == 1 and len(t.sent) == 2  # same connection
    feed(t, answer(b"again", close=True))
    async with await task as r:
        assert await r.text() == "again"
    task = await start(pool)
    assert len(pool.made) == 2 and t.aborted  # the engine said close
    task.cancel()


@settings(max_examples=60, deadline=None)
@given(body=st.binary(min_size=1, max_size=200), cuts=st.lists(st.integers(0, 400), max_size=6),
       chunked=st.booleans())
def test_any_split_of_the_answer_gives_the_same_body(body: bytes, cuts: list[int], chunked: bool) -> None:
    async def main() -> None:
        pool = FakePool()
        task = await start(pool)
        feed(pool.made[0], answer(body, chunked=chunked), cuts)
        async with await task as r:
            assert await r.read() == body
        assert pool._idle_get(("127.0.0.1", 9)) is not None

    asyncio.run(main())


async def test_a_connection_lost_mid_body_fails_the_read_and_is_not_reused() -> None:
    pool = FakePool()
    task = await start(pool)
    t = pool.made[0]
    feed(t, answer(b"0123456789")[:-4])
    r = await task
    assert await r.chunk() == b"012345"
    t.conn.connection_lost(ConnectionResetError("reset"))
    with pytest.raises(UpstreamError, match="connection lost"):
        await r.chunk()
    r.close()
    assert pool._idle_get(("127.0.0.1", 9)) is None


async def test_garbage_from_the_engine_is_an_upstream_error() -> None:
    pool = FakePool()
    task = await start(pool)
    t = pool.made[0]
    t.conn.data_received(b"SSH-2.0-OpenSSH\r\n\r\n")
    with pytest.raises(UpstreamError, match="malformed"):
        await task
    assert t.aborted


async def test_an_idle_connection_the_engine_closed_is_retried_once_on_a_fresh_one() -> None:
    pool = FakePool()
    task = await start(pool)
    feed(pool.made[0], answer(b"x"))
    async with await task as r:
        await r.read()
    task = await start(pool)
    pool.made[0].conn.connection_lost(None)  # closed before answering a byte
    await asyncio.sleep(0)
    assert len(pool.made) == 2 and len(pool.made[1].sent) == 1
    feed(pool.made[1], answer(b"y"))
    async with await task as r:
        assert await r.read() == b"y"
    # A fresh connection that closes is the engine's failure, not retried.
    pool._idle.clear()
    task = await start(pool)
    pool.made[2].conn.connection_lost(None)
    with pytest.raises(UpstreamError, match="closed the connection"):
        await task
    assert len(pool.made) == 3


async def test_reading_pauses_while_the_router_lags_and_leaving_early_closes_the_connection() -> None:
    pool = FakePool()
    task = await start(pool)
    t = pool.made[0]
    big = b"x" * (READ_HIGH_WATER + 10)
    t.conn.data_received(answer(b"", chunked=True).split(b"0\r\n\r\n")[0])  # head only, body to come
    r = await task
    t.conn.data_received(b"%x\r\n%s\r\n" % (len(big), big))
    assert t.paused
    assert await r.chunk() == big
    assert not t.paused
    r.close()  # body unfinished: the engine must see its client go
    assert t.aborted


async def test_cancelling_while_waiting_for_the_answer_closes_the_connection() -> None:
    pool = FakePool()
    task = await start(pool)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.made[0].aborted


async def test_only_plain_http_engine_urls() -> None:
    with pytest.raises(UpstreamError, match="unsupported"):
        await UpstreamPool().post("https://x:1", "/", b"")
