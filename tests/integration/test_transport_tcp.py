"""TCP transport on real sockets (127.0.0.1): transfers, multiplexing, reconnects, garbage, deadlines,
cancellation, backpressure and fault injection. Fixtures assert that nothing is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import Counter
from collections.abc import AsyncIterator

import numpy as np
import pytest

from actors.clock import Clock
from config.link import LinkProfile
from transport import (
    Block,
    BlockId,
    BlockNotFound,
    ConnectError,
    FaultPlan,
    FaultyTransport,
    IntegrityError,
    LinkModel,
    PeerGone,
    RequestId,
    ShapedTransport,
    Site,
    Topology,
    TransferTimeout,
    TransportError,
    TransportOptions,
)
from transport.base import Address, TransportStats
from transport.checksum import ChecksumName
from transport.frame import FrameType, encode_bytes
from transport.tcp import TcpTransport

pytestmark = pytest.mark.integration
A, B = Site("a", "r"), Site("b", "r")
R = RequestId("req")
CLEAN = TransportStats()


def blocks(n: int = 4, size: int = 100_000, seed: int = 0) -> list[Block]:
    rng = np.random.default_rng(seed)
    return [Block.of(i, rng.integers(0, 256, size, dtype=np.uint8), (i, i + 1)) for i in range(n)]


def same(got: list[Block], sent: list[Block]) -> bool:
    return [(g.block_id, g.layers, bytes(g.payload)) for g in got] == [(s.block_id, s.layers, bytes(s.payload))
                                                                       for s in sent]


async def settle(*ts: TcpTransport, connections: int | None = None) -> None:
    """Let in-flight acknowledgements, cancellations and closes land (up to a second)."""
    for _ in range(100):
        if all(t.stats().pending == t.stats().staged == t.stats().tasks == 0
               and t.pool.leases <= t.inbox.total_blocks()  # frames still on the wire hold a buffer
               and (connections is None or t.stats().connections == connections) for t in ts):
            return
        await asyncio.sleep(0.01)


@pytest.fixture
def clock() -> Clock:
    return Clock(1.0)


@pytest.fixture
async def pair(clock: Clock) -> AsyncIterator[tuple[TcpTransport, TcpTransport, Address]]:
    opts = TransportOptions(pool_bytes=64 << 20, max_frame_payload=16 << 20)
    a, b = TcpTransport(A, clock, opts), TcpTransport(B, clock, opts)
    addr = await b.serve()
    yield a, b, addr
    await settle(a, b)
    for t in (a, b):
        s = t.stats()
        assert (s.pending, s.staged, s.tasks, s.pool_leases) == (0, 0, 0, t.inbox.total_blocks() and s.pool_leases)
    await a.close()
    await b.close()
    assert a.stats() == CLEAN and b.stats() == CLEAN
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not left, f"tasks left behind: {left}"


async def test_push_receive_and_pull(pair) -> None:
    a, b, addr = pair
    sent = [*blocks(), Block.of(99, b"", (0, 80))]
    rec = await a.push(addr, R, sent)
    assert rec.backend == "tcp" and rec.blocks == 5 and rec.real_bytes == 400_000 and rec.wall_ms > 0
    with await b.receive(R, count=5) as got:
        assert same(got.blocks, sent)
        assert all(g.payload.readonly for g in got.blocks)
    assert b.pool.leases == 0
    b.publish(R, sent)
    sizes: list[int] = []
    with await a.pull(addr, R, [BlockId(3), BlockId(99), BlockId(0)], on_size=sizes.append) as got:
        assert same(got.blocks, [sent[3], sent[4], sent[0]]) and sizes == [200_000]
        owned = got.detach()
    assert a.pool.leases == 0 and same(owned, [sent[3], sent[4], sent[0]])
    with pytest.raises(BlockNotFound):
        await a.pull(addr, R, [BlockId(7)])


async def test_many_transfers_share_one_connection(pair) -> None:
    a, b, addr = pair
    sent = {i: blocks(3, 50_000, seed=i) for i in range(64)}
    for i in range(0, 64, 2):
        b.publish(RequestId(f"p{i}"), sent[i])

    async def one(i: int) -> bool:
        if i % 2:
            await a.push(addr, RequestId(f"p{i}"), sent[i])
            with await b.receive(RequestId(f"p{i}"), count=3) as got:
                return same(got.blocks, sent[i])
        with await a.pull(addr, RequestId(f"p{i}"), [BlockId(2), BlockId(0), BlockId(1)]) as got:
            return same(got.blocks, [sent[i][2], sent[i][0], sent[i][1]])

    assert all(await asyncio.gather(*(one(i) for i in range(64))))
    assert a.connects == 1 and b.stats().connections == 1


async def test_reconnects_after_a_reset(pair) -> None:
    a, b, addr = pair
    await a.push(addr, R, blocks(1))
    assert a.abort_connections(addr) == 1
    await asyncio.sleep(0.01)
    await a.push(addr, R, blocks(1))  # a fresh connection
    assert a.connects == 2
    b.discard(R)


async def test_reset_mid_transfer_fails_typed_and_cleans_up(pair) -> None:
    a, b, addr = pair
    big = blocks(8, 2_000_000)
    task = asyncio.ensure_future(a.push(addr, R, big))
    await asyncio.sleep(0.002)
    a.abort_connections(addr)
    try:
        await task
    except PeerGone:
        pass
    else:  # it may have finished first
        b.discard(R)
    await settle(b, connections=0)
    assert b.stats().staged == 0 and b.pool.leases == 0


async def test_connect_errors(clock: Clock) -> None:
    a = TcpTransport(A, clock)
    with pytest.raises(ConnectError):
        await a.push(Address("tcp", "127.0.0.1:1", B), R, blocks(1))
    await a.close()


async def test_garbage_closes_only_that_connection(pair) -> None:
    a, b, addr = pair
    await a.push(addr, R, blocks(1))
    host, port = addr.location.split(":")
    for junk in (b"GET / HTTP/1.1\r\n\r\n" + bytes(64), b"KVMF" + bytes(60),
                 encode_bytes(FrameType.ACK, {"t": 1, "ok": True})):  # a valid frame only servers send
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(junk)
        await writer.drain()
        assert await reader.read() == b""  # the server closed it
        writer.close()
        await writer.wait_closed()
    assert b.frame_errors == 3
    await a.push(addr, R, blocks(1))  # the first client's connection still serves
    assert a.connects == 1
    b.discard(R)


async def test_oversized_declaration_is_refused_unread(pair) -> None:
    _, b, addr = pair

    host, port = addr.location.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    allocations = b.pool.allocations
    writer.write(struct.pack("<4sBBBBIQQI", b"KVMF", 1, 1, 1, 0, 0, 1 << 62, 0, 0))
    assert await reader.read() == b""
    writer.close()
    await writer.wait_closed()
    assert b.pool.allocations == allocations and b.frame_errors == 1


@pytest.mark.parametrize(("repeat", "algo"), [(99, "xxh3"), (70_000, "xxh3"), (70_000, "sum64")])
async def test_corrupt_payload_fails_that_transfer_only(pair, repeat: int, algo: ChecksumName) -> None:
    """594 bytes (checked whole), 420 kB of xxh3 (hashed as it lands) and of sum64 (on the verifier thread)."""
    a, b, addr = pair
    host, port = addr.location.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    frame = bytearray(encode_bytes(FrameType.PUSH_DATA, {"t": 1, "i": 0, "b": 5, "l": [0, 1]}, b"abcdef" * repeat,
                                   algo=algo))
    frame[-3] ^= 0x40
    writer.write(bytes(frame) + encode_bytes(FrameType.PUSH_END, {"t": 1, "r": "x", "n": 1, "c": True}))
    await writer.drain()
    head = await reader.readexactly(32)
    meta = await reader.readexactly(int.from_bytes(head[8:12], "little"))
    assert b"integrity" in meta and b.inbox.count(RequestId("x")) == 0
    await a.push(addr, R, blocks(1))  # others unaffected; the raw connection is still open too
    writer.close()
    await writer.wait_closed()
    b.discard(R)


async def test_deadlines_leave_nothing_staged(pair, clock: Clock) -> None:
    a, b, addr = pair

    async def never() -> None:
        await asyncio.Event().wait()

    with pytest.raises(TransferTimeout):
        await a.push(addr, R, blocks(), gate=never, deadline_ms=clock.now_ms() + 50)
    await settle(a, b)
    assert b.stats().staged == 0 and b.inbox.count(R) == 0 and b.pool.leases == 0

    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    port = server.sockets[0].getsockname()[1]
    with pytest.raises(TransferTimeout):
        await a.pull(Address("tcp", f"127.0.0.1:{port}", B), R, [BlockId(0)], deadline_ms=clock.now_ms() + 50)
    server.close()
    a.abort_connections(Address("tcp", f"127.0.0.1:{port}", B))
    await server.wait_closed()


async def test_small_pushes_keep_every_guarantee_on_the_fast_path(pair, clock: Clock) -> None:
    """One-block pushes without a gate go as one frame and one future: same delivery, typed deadline
    misses flagged maybe-delivered, cancellation that leaves nothing pending."""
    a, b, addr = pair
    small = blocks(1, 4096, seed=3)
    for i in range(3):  # the first opens the connection, the rest reuse it
        await a.push(addr, RequestId(f"s{i}"), small)
        with await b.receive(RequestId(f"s{i}")) as got:
            assert same(got.blocks, small)
    assert a.connects == 1

    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    mute = Address("tcp", f"127.0.0.1:{server.sockets[0].getsockname()[1]}", B)
    for _ in range(2):  # connecting, then on the open connection
        with pytest.raises(TransferTimeout) as missed:
            await a.push(mute, R, small, deadline_ms=clock.now_ms() + 50)
        assert missed.value.maybe_delivered and "missed its deadline" in str(missed.value)
    # small pushes share one deadline timer: the earlier deadline fails first (or with the later one, when the
    # loop wakes after both), each typed, whatever order they started in
    late = asyncio.ensure_future(a.push(mute, R, small, deadline_ms=clock.now_ms() + 200))
    early = asyncio.ensure_future(a.push(mute, R, small, deadline_ms=clock.now_ms() + 20))
    done, _ = await asyncio.wait([late, early], return_when=asyncio.FIRST_COMPLETED)
    assert early in done
    for missed_push in (early, late):
        with pytest.raises(TransferTimeout, match="missed its deadline"):
            await missed_push
    stuck = asyncio.ensure_future(a.push(mute, R, small))
    await asyncio.sleep(0.01)
    stuck.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stuck
    assert a.stats().pending == 0 and a.pool.leases == 0
    a.abort_connections(mute)
    server.close()
    await server.wait_closed()


async def test_small_pushes_carry_any_block_id_layer_range_and_request_id(pair) -> None:
    """The small-push frame's fixed layout holds every block id (negative ones too); a layer past 32 bits
    goes as a msgpack frame instead. Either way the block arrives as sent."""
    a, b, addr = pair
    payload = np.arange(4096, dtype=np.uint8)
    cases = [(0, (0, 1), "r0"), (-(2**63), (3, 7), ""), (2**64 - 1, (0, 80), "réq-☃"), (5, (2**32, 2**32 + 1), "r3")]
    for bid, layers, rid in cases:
        sent = [Block.of(bid, payload, layers)]
        await a.push(addr, RequestId(rid), sent)
        with await b.receive(RequestId(rid)) as got:
            assert same(got.blocks, sent)
    assert a.connects == 1


async def test_cancellation_returns_every_buffer(pair) -> None:
    a, b, addr = pair
    big = blocks(16, 1_000_000)
    b.publish(R, big)
    for delay in (0.0, 0.001, 0.005):
        push = asyncio.ensure_future(a.push(addr, RequestId("c"), big))
        pull = asyncio.ensure_future(a.pull(addr, R, [BlockId(i) for i in range(16)]))
        await asyncio.sleep(delay)
        push.cancel()
        pull.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await push
        with contextlib.suppress(asyncio.CancelledError):
            (await pull).release()
        await settle(a, b)
        b.discard(RequestId("c"))  # the push may have committed before its cancellation
        await settle(a, b)
        assert a.pool.leases == 0 and b.pool.leases == 0 and b.stats().staged == 0


async def test_backpressure_stalls_then_recovers(clock: Clock) -> None:
    small = TransportOptions(pool_bytes=4 << 20, max_frame_payload=1 << 20, max_inflight_bytes=2 << 20)
    a, b = TcpTransport(A, clock, small), TcpTransport(B, clock, small)
    addr = await b.serve()
    await a.push(addr, RequestId("fill"), blocks(4, 1 << 20))  # the receiver's pool is now full
    with pytest.raises(TransferTimeout):
        await a.push(addr, R, blocks(2, 1 << 20), deadline_ms=clock.now_ms() + 200)
    b.discard(RequestId("fill"))
    await a.push(addr, R, blocks(2, 1 << 20))  # the stalled connection resumed reading
    with await b.receive(R, count=2) as got:
        assert same(got.blocks, blocks(2, 1 << 20))
    await settle(a, b)
    assert b.pool.leases == 0
    await a.close()
    await b.close()


async def test_faults_never_deliver_corrupt_bytes(clock: Clock) -> None:
    plan = FaultPlan.every_kind(0.7, seed=11, delay_ms=(0.0, 40.0), reset_after_ms=(0.0, 1.0))
    a = FaultyTransport(TcpTransport(A, clock), plan)
    b = FaultyTransport(TcpTransport(B, clock), plan)
    addr = await b.serve()
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        rid = RequestId(f"r{i}")
        sent = blocks(2, 20_000, seed=i)
        async with sem:
            try:
                async with asyncio.timeout(5):  # a hang guard: every call has a 100 ms deadline
                    if i % 2:
                        await a.push(addr, rid, sent, deadline_ms=clock.now_ms() + 100)
                        got = await b.receive(rid, count=2, deadline_ms=clock.now_ms() + 100)
                    else:
                        b.publish(rid, sent)
                        got = await a.pull(addr, rid, [BlockId(0), BlockId(1)], deadline_ms=clock.now_ms() + 100)
            except TransportError as e:
                outcomes[type(e).__name__] += 1
                b.discard(rid)
                return
            finally:
                b.withdraw(rid)
            with got:
                assert same(got.blocks, sent), "silent corruption"
            outcomes["ok"] += 1

    await asyncio.gather(*(one(i) for i in range(300)))
    assert outcomes["ok"] > 50 and outcomes["IntegrityError"] > 0 and outcomes["TransferTimeout"] > 0
    await settle(a.inner, b.inner)  # type: ignore[arg-type]
    assert b.stats().staged == 0
    await a.close()
    await b.close()
    assert a.stats() == CLEAN and b.stats() == CLEAN


async def test_shaped_records(pair, clock: Clock) -> None:
    a, b, addr = pair
    link = LinkProfile(name="slow", source="test", kind="tcp", bandwidth_gbps=0.5, latency_us=500.0)
    shaped = ShapedTransport(a, LinkModel(Topology.flat(link), clock, payload_scale=0.25))
    rec = await shaped.push(addr, R, blocks(2, 250_000))  # 0.5 MB real = 2 MB emulated: 4 ms + 0.5 ms
    assert rec.link == "slow" and rec.emulated_bytes == 2_000_000
    assert rec.modelled_ms == pytest.approx(4.5, rel=1e-6) and rec.emulated_ms >= rec.modelled_ms
    with await b.receive(R, count=2) as got:
        assert same(got.blocks, blocks(2, 250_000))
    b.publish(R, blocks(1, 250_000))
    with await shaped.pull(addr, R, [BlockId(0)]) as got:
        assert got.record is not None and got.record.modelled_ms == pytest.approx(0.5 + 2.0 + 0.5, rel=1e-6)
    with pytest.raises(IntegrityError):
        bad = blocks(1)[0].with_checksum()
        assert bad.checksum is not None
        await shaped.push(addr, R, [Block(bad.block_id, bad.payload, bad.layers, bad.checksum ^ 1)])
