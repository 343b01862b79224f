"""Consecutive small blocks as one table frame (transport.coalesce): which blocks go together, the table's
checks, the shared receive buffer, and a push and a pull of many small blocks over a tcp client and server
joined by an in-memory pipe (one frame each way, the same blocks, ids, layers and checksums delivered)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.unit.transport.test_small_push_path import joined  # noqa: F401  (the fixture)
from transport.base import Block, BlockId, FrameError, IntegrityError, RequestId
from transport.checksum import ALGO_IDS, checksum_of
from transport.coalesce import COALESCE_BLOCK_MAX, COALESCE_MAX, COALESCE_ROWS, pack, runs, share, unpack
from transport.frame import FrameType, encode_bytes
from transport.pool import BufferPool
from transport.session import small_push_fits


def blocks_of(sizes: list[int]) -> list[Block]:
    rng = np.random.default_rng(len(sizes))
    return [Block.of(i, rng.integers(0, 256, n, dtype=np.uint8), (i % 3, i % 3 + 2)) for i, n in enumerate(sizes)]


def test_runs_group_consecutive_small_blocks_and_leave_large_ones_alone() -> None:
    big = COALESCE_BLOCK_MAX + 1
    assert runs(blocks_of([10, 20, big, 30, big, 40, 50, 60])) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 8)]
    assert runs(blocks_of([100])) == [(0, 1)]
    assert runs([]) == []
    full = COALESCE_MAX // COALESCE_BLOCK_MAX
    assert runs(blocks_of([COALESCE_BLOCK_MAX] * (full + 1))) == [(0, full), (full, full + 1)]  # cut at the byte cap
    assert runs(blocks_of([1] * (COALESCE_ROWS + 2))) == [(0, COALESCE_ROWS), (COALESCE_ROWS, COALESCE_ROWS + 2)]
    assert runs(blocks_of([4096] * 8), most=8192) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # a backend's own cap


def test_several_small_blocks_fit_the_small_push_path_up_to_its_size() -> None:
    assert small_push_fits(blocks_of([4096] * 16))  # 64 KiB in all
    assert not small_push_fits(blocks_of([4096] * 16 + [1]))  # over SMALL_PUSH
    assert not small_push_fits(blocks_of([4096] * 16), most=16 * 1024)  # over a backend's table frame size
    assert not small_push_fits(blocks_of([100]))  # one block: the one-block small push
    assert not small_push_fits(blocks_of([1] * (COALESCE_ROWS + 1)))
    assert not small_push_fits(blocks_of([10, COALESCE_BLOCK_MAX + 1]), most=1 << 20)


def test_a_table_checks_each_block_and_names_the_corrupt_one() -> None:
    blocks = blocks_of([5, 0, 700, 64])
    table, payload = pack(blocks, "auto")
    payload[5 + 3] ^= 0xFF  # inside block 2 (block 1 is empty)
    got, bad = unpack(table, memoryview(payload))
    assert bad == 2
    assert [(g.block_id, g.layers, g.nbytes) for g in got] == [(b.block_id, b.layers, b.nbytes) for b in blocks]
    supplied = Block.decoded(9, memoryview(b"abc").toreadonly(), (0, 1), 1234, "crc32")  # a wrong supplied checksum
    table, payload = pack([blocks[0], supplied], "auto")
    assert table[1][4:] == [ALGO_IDS["crc32"], 1234] and unpack(table, memoryview(payload))[1] == 9


ROW = [7, 0, 1, 4, ALGO_IDS["xxh3"], checksum_of("xxh3", b"abcd")]


@pytest.mark.parametrize(("table", "match"), [
    (None, "block table"),
    ([], "block table"),
    ({"7": ROW}, "block table"),
    ([ROW[:5]], "row must be"),
    (["row"], "row must be"),
    ([[*ROW[:3], "4", *ROW[4:]]], "integer"),
    ([[*ROW[:3], 4.0, *ROW[4:]]], "integer"),
    ([[ROW[0], True, *ROW[2:]]], "integer"),
    ([[ROW[0], 3, 3, *ROW[3:]]], "layer range"),
    ([[ROW[0], -1, 1, *ROW[3:]]], "layer range"),
    ([[2**64, *ROW[1:]]], "64 bits"),
    ([[-(2**63) - 1, *ROW[1:]]], "64 bits"),
    ([[*ROW[:5], -1]], "64 bits"),
    ([[*ROW[:4], 99, ROW[5]]], "unknown checksum"),
    ([[*ROW[:3], -4, *ROW[4:]]], "overrun"),
    ([[*ROW[:3], 5, *ROW[4:]]], "overrun"),
    ([[*ROW[:3], 3, *ROW[4:]]], "add up"),
    ([ROW, ROW], "overrun"),
    ([ROW] * 4097, "block table"),
])
def test_a_malformed_table_is_a_frame_error(table: Any, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        unpack(table, memoryview(b"abcd"))


def test_a_shared_buffer_goes_back_with_its_last_part() -> None:
    pool = BufferPool(1 << 20)
    lease = pool.acquire(1000)
    assert lease is not None
    parts = share(lease, 3)
    for part in parts[:2]:
        assert part is not None
        part.release()
        part.release()  # a part released twice counts once
    assert pool.leases == 1 and not lease.released
    assert parts[2] is not None
    parts[2].release()
    assert pool.leases == 0 and lease.released
    assert share(None, 2) == [None, None]


async def test_a_push_of_small_blocks_is_one_frame_and_delivers_every_block(joined: Any) -> None:  # noqa: F811
    a, b, addr, client, out, ret = joined
    sent = blocks_of([2048] * 12 + [0, 1, 999])
    small: list[Any] = []
    send_small = client.send_small

    def spy(*args: Any) -> Any:
        small.append(send_small(*args))
        return small[-1]

    client.send_small = spy
    rec = await a.push(addr, RequestId("many"), sent)
    assert len(small) == 1 and small[0] is not None  # the small-push path took it, whole
    assert rec.blocks == len(sent) and rec.real_bytes == sum(s.nbytes for s in sent)
    assert out.frames == [FrameType.PUSH_DATA] and ret.frames == [FrameType.ACK]
    got = await b.receive(RequestId("many"), count=len(sent))
    assert [(g.block_id, g.layers, bytes(g.payload), g.checksum) for g in got.blocks] == [
        (s.block_id, s.layers, bytes(s.payload), checksum_of("xxh3", s.payload)) for s in sent]
    assert b.pool.leases == 1  # one buffer for the frame, held by all its blocks
    got.release()
    assert b.pool.leases == 0 and client.pending == {} and client.budget.used == 0


async def test_a_push_over_the_small_push_size_is_table_frames_on_the_general_path(joined: Any) -> None:  # noqa: F811
    a, b, addr, client, _out, ret = joined
    sent = blocks_of([3000] * 30)  # 90,000 bytes: over SMALL_PUSH, one table frame (under COALESCE_MAX)
    rec = await a.push(addr, RequestId("big"), sent)
    assert rec.blocks == 30 and ret.frames == [FrameType.ACK]
    with await b.receive(RequestId("big"), count=30) as got:
        assert [(g.block_id, bytes(g.payload)) for g in got.blocks] == [(s.block_id, bytes(s.payload)) for s in sent]
        assert b.pool.leases == 1
    assert client.pending == {} and client.budget.used == 0


async def test_a_block_replaced_in_the_inbox_keeps_the_shared_buffer_for_the_others(joined: Any) -> None:  # noqa: F811
    a, b, addr, _client, _out, _ret = joined
    sent = blocks_of([100] * 4)
    await a.push(addr, RequestId("r"), sent)
    await a.push(addr, RequestId("r"), [sent[1]])  # a retry of one block replaces that block's copy
    assert b.pool.leases == 2  # the retry's, and the first frame's: blocks 0, 2 and 3 still view it
    with await b.receive(RequestId("r"), count=4) as got:
        assert sorted((g.block_id, bytes(g.payload)) for g in got.blocks) == [
            (s.block_id, bytes(s.payload)) for s in sent]
    assert b.pool.leases == 0


async def test_a_corrupt_block_in_a_table_fails_the_push_and_the_connection_carries_on(joined: Any) -> None:  # noqa: F811
    a, b, addr, client, _out, _ret = joined
    good = blocks_of([64] * 3)
    bad = Block.decoded(5, memoryview(bytes(64)).toreadonly(), (0, 1), 12345, "xxh3")  # a wrong supplied checksum
    with pytest.raises(IntegrityError, match="block 5 arrived corrupted"):
        await a.push(addr, RequestId("bad"), [*good, bad])
    await a.push(addr, RequestId("good"), good)
    assert b.inbox.count(RequestId("bad")) == 0 and b.inbox.count(RequestId("good")) == 3
    assert client.pending == {} and client.budget.used == 0


async def test_a_pull_of_small_blocks_is_answered_with_one_data_frame(joined: Any) -> None:  # noqa: F811
    a, b, addr, _client, _out, ret = joined
    offered = blocks_of([1500] * 10)
    b.publish(RequestId("p"), offered)
    ids = [BlockId(s.block_id) for s in offered]
    with await a.pull(addr, RequestId("p"), ids) as got:
        assert [(g.block_id, g.layers, bytes(g.payload)) for g in got.blocks] == [
            (s.block_id, s.layers, bytes(s.payload)) for s in offered]
        assert a.pool.leases == 1
    assert ret.frames == [FrameType.PULL_HEAD, FrameType.PULL_DATA, FrameType.PULL_END]
    assert a.pool.leases == 0


async def test_a_garbage_table_on_the_wire_closes_only_that_connection(joined: Any) -> None:  # noqa: F811
    _a, b, _addr, _client, out, ret = joined
    garbage = {"t": 99, "i": 0, "bt": [[1, 0, 1, 5, ALGO_IDS["xxh3"], 0]], "r": "x", "n": 1, "c": True}
    out.write(encode_bytes(FrameType.PUSH_DATA, garbage, b"abc"))  # the table claims 5 bytes, the payload has 3
    await asyncio.sleep(0)
    assert ret.closing and b.frame_errors == 1 and b.pool.leases == 0 and b.inbox.count(RequestId("x")) == 0
