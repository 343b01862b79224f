"""The router's aiohttp client, per read of an answer's body: reading resumed only where it was paused
(``_ResumeWhenPaused``), and the body's read timeout kept by one watch rather than a timer per chunk
(``_SilenceWatch``). No sockets: aiohttp's protocol and stream reader on fakes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.helpers import TimerNoop
from aiohttp.streams import StreamReader

from cluster.router.upstream import AiohttpResponse, UpstreamError, _ResumeWhenPaused, _SilenceWatch


def test_an_unpaused_connection_is_not_resumed_at_each_read() -> None:
    loop = asyncio.new_event_loop()
    try:
        proto = _ResumeWhenPaused(loop=loop)
        fed: list[bytes] = []
        proto.data_received = fed.append  # type: ignore[method-assign,assignment]
        proto.resume_reading()
        assert fed == []  # aiohttp 3.14's own ResponseHandler parses b"" here
        proto._reading_paused = True
        proto._upgraded = False
        proto.resume_reading()
        assert fed == [b""] and not proto._reading_paused  # a paused one resumes as aiohttp resumes it
    finally:
        loop.close()


class _Protocol:
    def __init__(self) -> None:
        self.read_timeout: float | None = 600.0
        self.dropped = 0

    def _drop_timeout(self) -> None:
        self.dropped += 1


class _Connection:
    def __init__(self) -> None:
        self.protocol = _Protocol()


class _Resp:
    """What ``AiohttpResponse`` uses of aiohttp's ``ClientResponse``."""

    def __init__(self, content: StreamReader) -> None:
        self.status = 200
        self.headers: dict[str, str] = {}
        self.connection = _Connection()
        self.content = content
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        pass


class _ReaderProtocol:
    """The protocol a ``StreamReader`` talks to (connected, never paused)."""

    _reading_paused = False
    connected = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


async def test_a_body_silent_past_the_read_timeout_raises_and_the_per_chunk_timer_is_off() -> None:
    content = StreamReader(_ReaderProtocol(), 2**16, loop=asyncio.get_running_loop(),  # type: ignore[arg-type]
                           timer=TimerNoop())
    raw = _Resp(content)
    watch = _SilenceWatch(0.05)
    up = AiohttpResponse(raw, watch)  # type: ignore[arg-type]
    proto = raw.connection.protocol
    assert proto.read_timeout is None and proto.dropped == 1  # aiohttp's re-armed timer is off for the body
    content.feed_data(b"data: 1\n\n")
    assert await up.chunk() == b"data: 1\n\n" and up.waiting_since == 0.0
    with pytest.raises(UpstreamError, match="silent past the read timeout"):
        await asyncio.wait_for(up.chunk(), 10)  # nothing more comes: the watch ends the wait
    up.close()
    assert raw.closed and not watch.open


async def test_a_body_that_keeps_coming_is_not_cut_off_and_the_watch_stops_when_none_is_open() -> None:
    content = StreamReader(_ReaderProtocol(), 2**16, loop=asyncio.get_running_loop(),  # type: ignore[arg-type]
                           timer=TimerNoop())
    watch = _SilenceWatch(0.05)
    up = AiohttpResponse(_Resp(content), watch)  # type: ignore[arg-type]
    for i in range(8):  # each read waits less than the limit: 8 x 0.02 s of reads in all, past it in sum
        asyncio.get_running_loop().call_later(0.02, content.feed_data, b"data: %d\n\n" % i)
        assert await up.chunk() == b"data: %d\n\n" % i
    content.feed_eof()
    assert await up.chunk() == b""
    up.close()
    await asyncio.sleep(0.1)
    assert not watch.open and watch._handle is None


def test_no_read_timeout_no_watch() -> None:
    from cluster.router.upstream import AiohttpUpstream, UpstreamLimits

    assert AiohttpUpstream(UpstreamLimits(read_timeout_s=None))._watch is None
    assert isinstance(aiohttp.ServerTimeoutError(), TimeoutError)  # what the watch raises maps to the timeout message
