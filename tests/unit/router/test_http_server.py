"""The router's HTTP/1.1 server, protocol only: request bytes in, answer bytes out, through a recording transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from cluster.router.http_server import (
    HTTPServer,
    Request,
    Response,
    StreamResponse,
    _Connection,
    json_response,
)


class FakeTransport(asyncio.Transport):
    def __init__(self, conn: _Connection) -> None:
        super().__init__()
        self.conn = conn
        self.out = bytearray()
        self.closing = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.conn.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def server() -> HTTPServer:
    srv = HTTPServer(max_body=1000)

    async def echo(req: Request) -> Response:
        return json_response({"method": req.method, "path": req.path, "body": (await req.read()).decode(),
                              "x": req.headers.get("x-thing")})

    async def named(req: Request) -> Response:
        return Response(body=req.match_info["name"].encode())

    async def broken(req: Request) -> Response:
        raise RuntimeError("secret internals")

    async def stream(req: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b"data: 1\n\n")
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    srv.add("POST", "/echo", echo)
    srv.add("GET", "/echo", echo)
    srv.add("DELETE", "/things/{name}", named)
    srv.add("GET", "/broken", broken)
    srv.add("GET", "/stream", stream)
    return srv


def run(srv: HTTPServer, chunks: list[bytes], until: Callable[[FakeTransport], bool] | None = None,
        setup: Callable[[FakeTransport], Awaitable[Any]] | None = None) -> FakeTransport:
    async def main() -> FakeTransport:
        conn = _Connection(srv)
        t = FakeTransport(conn)
        conn.connection_made(t)
        for c in chunks:
            conn.data_received(c)
        for _ in range(200):
            await asyncio.sleep(0)
            if until is not None and until(t):
                break
        if setup is not None:
            await setup(t)
        return t

    return asyncio.run(main())


def answers(out: bytes | bytearray) -> list[tuple[int, dict[str, str], bytes]]:
    """Parse every answer on the wire (content-length or chunked)."""
    res = []
    data = bytes(out)
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if status == 100:
            continue
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, data = data[:n], data[n:]
        else:
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                n = int(size, 16)
                body += data[:n]
                data = data[n + 2:]
                if n == 0:
                    break
        res.append((status, headers, body))
    return res


def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    req = (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Thing: a\r\nContent-Length: 5\r\n\r\nhello"
           b"GET /echo?q=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    t = run(server(), [req[:17], req[17:40], req[40:]], until=lambda t: len(answers(t.out)) == 2)
    (s1, h1, b1), (s2, _, b2) = answers(t.out)
    assert s1 == s2 == 200 and h1["content-type"].startswith("application/json")
    assert json.loads(b1) == {"method": "POST", "path": "/echo", "body": "hello", "x": "a"}
    assert json.loads(b2)["path"] == "/echo"
    assert not t.closing  # kept alive


def test_chunked_request_body_and_expect_continue() -> None:
    req = (b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    t = run(server(), [req], until=lambda t: b"abcde" in t.out)
    assert t.out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert json.loads(answers(t.out)[0][2])["body"] == "abcde"


def test_garbage_gets_a_400_that_says_why_and_the_connection_closes() -> None:
    t = run(server(), [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n"],
            until=lambda t: t.closing)
    (status, _, body), = answers(t.out)
    assert status == 400 and "malformed HTTP request" in json.loads(body)["error"]["message"]
    assert t.closing


def test_limits_on_body_and_headers() -> None:
    t = run(server(), [b"POST /echo HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100],
            until=lambda t: t.closing)
    assert answers(t.out)[0][0] == 413 and t.closing
    t = run(server(), [b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                       + b"".join(b"64\r\n" + b"y" * 100 + b"\r\n" for _ in range(11))], until=lambda t: t.closing)
    assert answers(t.out)[0][0] == 413
    t = run(server(), [b"GET /echo HTTP/1.1\r\n" + b"X-Big: " + b"z" * 70_000 + b"\r\n\r\n"],
            until=lambda t: t.closing)
    assert answers(t.out)[0][0] == 431


def test_routes_404_405_match_info_and_a_handler_bug_is_a_500_without_internals() -> None:
    req = (b"GET /nope HTTP/1.1\r\n\r\nPUT /echo HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
           b"DELETE /things/w-7 HTTP/1.1\r\n\r\nGET /broken HTTP/1.1\r\n\r\n")
    t = run(server(), [req], until=lambda t: len(answers(t.out)) == 4)
    got = answers(t.out)
    assert [a[0] for a in got] == [404, 405, 200, 500]
    assert got[2][2] == b"w-7" and b"secret" not in got[3][2]


def test_streamed_answer_is_chunked_and_http10_closes() -> None:
    t = run(server(), [b"GET /stream HTTP/1.1\r\n\r\n"], until=lambda t: t.out.endswith(b"0\r\n\r\n"))
    (status, headers, body), = answers(t.out)
    assert status == 200 and headers["transfer-encoding"] == "chunked" and body == b"data: 1\n\ndata: 2\n\n"
    t = run(server(), [b"GET /echo HTTP/1.0\r\n\r\n"], until=lambda t: t.closing)
    (status, headers, _), = answers(t.out)
    assert status == 200 and headers["connection"] == "close" and t.closing
    # HTTP/1.0 has no chunks: the events go raw and the close ends them, keep-alive asked or not.
    t = run(server(), [b"GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"], until=lambda t: t.closing)
    head, _, body = bytes(t.out).partition(b"\r\n\r\n")
    assert b"chunked" not in head and body == b"data: 1\n\ndata: 2\n\n" and t.closing


def test_a_client_that_leaves_cancels_its_handler() -> None:
    srv = HTTPServer(max_body=1000)
    seen: list[str] = []

    async def slow(req: Request) -> Response:
        seen.append("started")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return Response(body=b"late")

    srv.add("GET", "/slow", slow)

    async def leave(t: FakeTransport) -> None:
        t.close()
        for _ in range(5):
            await asyncio.sleep(0)

    t = run(srv, [b"GET /slow HTTP/1.1\r\n\r\n"], until=lambda t: bool(seen), setup=leave)
    assert seen == ["started", "cancelled"] and b"late" not in t.out
