"""The small-push round trip as one synchronous call chain, without sockets: the decoder's direct hand-off, and
a tcp client and server joined by an in-memory pipe (bytes handed over on the next loop step)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from actors.clock import Clock
from transport.base import Address, Block, IntegrityError, RequestId, Site, TransferTimeout
from transport.checksum import ChecksumName, checksum_of
from transport.frame import FrameDecoder, FrameType, Limits, encode_ack, encode_bytes, encode_small_push
from transport.pool import BufferPool, Lease
from transport.session import Client
from transport.tcp import FrameConnection, TcpTransport


class Sink:
    """Records what a decoder hands over directly."""

    def __init__(self) -> None:
        self.acks: list[int] = []
        self.pushes: list[tuple[Any, ...]] = []

    def on_ack(self, tid: int) -> None:
        self.acks.append(tid)

    def on_small_push(self, t: int, b: int, layers: tuple[int, int], request_id: str, expires_at: float,
                      payload: memoryview, lease: Lease | None, checksum: int, algo: ChecksumName,
                      intact: bool) -> None:
        self.pushes.append((t, b, layers, request_id, expires_at, bytes(payload), checksum, algo, intact))
        if lease is not None:
            lease.release()


def small_push(tid: int, payload: bytes, block_id: int = -3) -> bytes:
    body = memoryview(payload)
    return encode_small_push(tid, block_id, (2, 5), "réq", 1e9, body, checksum_of("xxh3", body), "xxh3") + payload


def test_a_lone_ack_or_small_push_goes_straight_to_the_direct_sink_verified() -> None:
    dec = FrameDecoder(BufferPool(1 << 20), Limits(max_meta_bytes=4096, max_payload=1 << 16))
    dec.direct = sink = Sink()
    corrupt = bytearray(small_push(4, b"kv" * 2048))
    corrupt[-1] ^= 1
    assert dec.feed(encode_ack(7)) == []
    assert dec.feed(small_push(3, b"kv" * 2048)) == []
    assert dec.feed(bytes(corrupt)) == []
    assert dec.feed(small_push(5, b"")) == []
    assert sink.acks == [7]
    want = checksum_of("xxh3", b"kv" * 2048)
    assert sink.pushes == [(3, -3, (2, 5), "réq", 1e9, b"kv" * 2048, want, "xxh3", True),
                           (4, -3, (2, 5), "réq", 1e9, b"kv" * 2047 + b"kw", want, "xxh3", False),
                           (5, -3, (2, 5), "réq", 1e9, b"", 0, "xxh3", True)]
    assert dec.pool.leases == 0


def test_frames_completed_behind_another_in_one_read_keep_their_order() -> None:
    dec = FrameDecoder(BufferPool(1 << 20), Limits(max_meta_bytes=4096, max_payload=1 << 16))
    dec.direct = sink = Sink()
    frames = dec.feed(encode_bytes(FrameType.ACK, {"t": 8, "ok": False, "e": "timeout", "m": "late"})
                      + encode_ack(7) + small_push(3, b"x" * 100))
    assert [(f.type, f.meta["t"]) for f in frames] == [(FrameType.ACK, 8), (FrameType.ACK, 7),
                                                      (FrameType.PUSH_DATA, 3)]
    assert frames[2].intact and bytes(frames[2].payload) == b"x" * 100
    assert sink.acks == [] and sink.pushes == []
    frames[2].release()


class Pipe:
    """One direction of an in-memory connection: each write reaches the peer's protocol on the next loop step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.peer: FrameConnection | None = None
        self.closing = False
        self.mute = False
        """Drop what is written (a peer that never answers)."""
        self.frames: list[int] = []
        """The frame type of every write (each small-push path write is one whole frame)."""

    def write(self, data: bytes) -> None:
        self.frames.append(data[5])
        if not self.mute:
            self.loop.call_soon(self._deliver, bytes(data))

    def _deliver(self, data: bytes) -> None:
        assert self.peer is not None
        view = memoryview(data)
        while view.nbytes:
            buf = self.peer.get_buffer(-1)
            k = min(buf.nbytes, view.nbytes)
            buf[:k] = view[:k]
            view = view[k:]
            self.peer.buffer_updated(k)

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def abort(self) -> None:
        self.closing = True


@pytest.fixture
async def joined() -> Any:
    """A tcp sender whose client to ``b`` is joined to ``b``'s server side by two pipes."""
    loop = asyncio.get_running_loop()
    a, b = TcpTransport(Site("a", "local"), Clock()), TcpTransport(Site("b", "local"), Clock())
    addr = Address("tcp", "pipe:1", b.site)
    client = Client(a, addr.location)
    there = a._connection(lambda _c: client)
    back = b._connection(b._accepted)
    out, ret = Pipe(loop), Pipe(loop)
    out.peer, ret.peer = back, there
    there.connection_made(out)  # type: ignore[arg-type]
    back.connection_made(ret)  # type: ignore[arg-type]
    client.conn = there
    a._clients[addr.location] = client
    yield a, b, addr, client, out, ret
    client.close()
    await a.close()
    await b.close()


async def test_a_small_push_is_written_whole_answered_and_delivered(joined: Any) -> None:
    a, b, addr, client, out, ret = joined
    payload = np.arange(4096, dtype=np.uint8)
    rec = await a.push(addr, RequestId("r1"), [Block.of(9, payload, (0, 4))])
    assert (rec.blocks, rec.real_bytes, rec.backend) == (1, 4096, "tcp")
    assert out.frames == [FrameType.PUSH_DATA] and ret.frames == [FrameType.ACK]
    with await b.receive(RequestId("r1")) as got:
        assert [(g.block_id, g.layers, bytes(g.payload)) for g in got.blocks] == [(9, (0, 4), payload.tobytes())]
    assert client.pending == {} and client.budget.used == 0


async def test_a_corrupt_small_push_fails_clearly_and_the_connection_carries_on(joined: Any) -> None:
    a, b, addr, client, _out, _ret = joined
    good = np.ones(4096, dtype=np.uint8)
    bad = Block.decoded(1, memoryview(good.tobytes()).toreadonly(), (0, 1), 12345, "xxh3")  # a wrong checksum
    with pytest.raises(IntegrityError, match="corrupted") as e:
        await a.push(addr, RequestId("bad"), [bad])
    assert not e.value.maybe_delivered
    await a.push(addr, RequestId("good"), [Block.of(2, good)])
    assert b.inbox.count(RequestId("bad")) == 0 and b.inbox.count(RequestId("good")) == 1
    assert client.pending == {} and client.budget.used == 0 and b.pool.leases == 1


async def test_an_unanswered_small_push_misses_its_deadline_and_is_cancelled(joined: Any) -> None:
    a, _b, addr, client, out, ret = joined
    ret.mute = True
    with pytest.raises(TransferTimeout) as e:
        await a.push(addr, RequestId("late"), [Block.of(1, np.zeros(64, dtype=np.uint8))],
                     deadline_ms=a.clock.now_ms() + 1.0)
    assert e.value.maybe_delivered  # it was written: the receiver may have committed it
    assert out.frames == [FrameType.PUSH_DATA, FrameType.CANCEL]
    assert client.pending == {} and client.budget.used == 0


async def test_a_cancelled_small_push_sends_cancel_and_returns_its_budget(joined: Any) -> None:
    a, _b, addr, client, out, ret = joined
    ret.mute = True
    task = asyncio.ensure_future(a.push(addr, RequestId("c"), [Block.of(1, np.zeros(64, dtype=np.uint8))]))
    await asyncio.sleep(0)
    assert client.budget.used == 64
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert out.frames == [FrameType.PUSH_DATA, FrameType.CANCEL]
    assert client.pending == {} and client.budget.used == 0


class HeldVerifier:
    """A verifier that checks nothing until told (``judge``): frames wait behind the one it holds."""

    def __init__(self) -> None:
        self.waiting: list[tuple[memoryview, int, Any]] = []

    def submit(self, algo: ChecksumName, payload: memoryview, expected: int, done: Any) -> None:
        self.waiting.append((payload, expected, done))

    def judge(self) -> None:
        for payload, expected, done in self.waiting:
            done(checksum_of("sum64", payload) == expected)
        self.waiting.clear()


class Recorder(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[FrameType, int]] = []

    def on_frame(self, f: Any) -> None:
        self.frames.append((f.type, f.meta["t"]))
        f.release()

    def on_lost(self, exc: BaseException | None) -> None:
        pass


async def test_a_small_push_behind_a_frame_held_for_the_verifier_waits_its_turn() -> None:
    verifier, handler = HeldVerifier(), Recorder()
    conn = FrameConnection(BufferPool(1 << 22), Limits(max_meta_bytes=4096, max_payload=1 << 20),
                           lambda _c: handler, None, verifier, 64 * 1024)  # type: ignore[arg-type]
    conn.connection_made(Pipe(asyncio.get_running_loop()))  # type: ignore[arg-type]
    big = encode_bytes(FrameType.PUSH_DATA, {"t": 1, "i": 0, "b": 0, "l": [0, 1]}, bytes(256 * 1024), algo="sum64")
    for part in (big[:100], big[100:], small_push(2, b"x" * 64)):  # the large payload lands in the payload state
        _feed(conn, part)
    assert len(verifier.waiting) == 1 and handler.frames == [] and handler.pushes == []  # the push waits
    verifier.judge()
    assert handler.frames == [(FrameType.PUSH_DATA, 1), (FrameType.PUSH_DATA, 2)]  # in order, as frames
    _feed(conn, small_push(3, b"y" * 64))
    assert [p[0] for p in handler.pushes] == [3]  # nothing held: straight to the handler again


def _feed(conn: FrameConnection, data: bytes) -> None:
    pipe = Pipe(asyncio.get_running_loop())
    pipe.peer = conn
    pipe._deliver(data)
