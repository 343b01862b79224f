"""Properties of table frames (transport.coalesce): any sequence of blocks round-trips identically through
runs, pack, the wire (msgpack metadata and a frame) and unpack; any garbage table is a FrameError or a
table that adds up, never another exception."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.base import Block, FrameError
from transport.checksum import ChecksumName, checksum_of
from transport.coalesce import COALESCE_BLOCK_MAX, pack, runs, unpack
from transport.frame import FrameDecoder, FrameType, Limits, encode_bytes
from transport.pool import BufferPool

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

block_specs = st.lists(st.tuples(
    st.integers(-(2**63), 2**64 - 1),  # id
    st.integers(0, 2**31), st.integers(1, 64),  # layer start, span
    st.one_of(st.integers(0, 3000), st.sampled_from([0, COALESCE_BLOCK_MAX, COALESCE_BLOCK_MAX + 1])),  # size
    st.sampled_from([None, "xxh3", "sum64", "crc32"]),  # a supplied checksum's algorithm, or none
    st.integers(0, 255)), max_size=24)


def make(specs: list[tuple[int, int, int, int, ChecksumName | None, int]]) -> list[Block]:
    out = []
    for b, lo, span, n, algo, fill in specs:
        payload = memoryview(bytes([fill]) * n).toreadonly()
        if algo is None:
            out.append(Block.of(b, payload, (lo, lo + span)))
        else:
            out.append(Block.decoded(b, payload, (lo, lo + span), checksum_of(algo, payload), algo))
    return out


@settings(PROPS, max_examples=80)
@given(block_specs, st.sampled_from(["auto", "sum64"]), st.integers(1, 300_000))
def test_any_blocks_round_trip_through_table_frames(specs: list[Any], choice: Any, most: int) -> None:
    blocks = make(specs)
    spans = runs(blocks, most)
    assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(len(blocks)))  # every block once, in order
    dec = FrameDecoder(BufferPool(1 << 22), Limits(max_payload=1 << 20))
    for lo, hi in spans:
        if hi - lo == 1:
            continue
        group = blocks[lo:hi]
        assert sum(b.nbytes for b in group) <= most and all(b.nbytes <= COALESCE_BLOCK_MAX for b in group)
        table, payload = pack(blocks[lo:hi], choice)
        [f] = dec.feed(encode_bytes(FrameType.PUSH_DATA, {"t": 1, "i": lo, "bt": table}, payload))
        assert f.intact
        got, bad = unpack(f.meta["bt"], f.payload)
        assert bad is None
        for g, s in zip(got, blocks[lo:hi], strict=True):
            assert (g.block_id, g.layers, bytes(g.payload)) == (s.block_id, s.layers, bytes(s.payload))
            assert g.checksum == (s.checksum if s.checksum is not None else checksum_of(g.checksum_algo, s.payload))
            assert g.checksum_algo == (s.checksum_algo if s.checksum is not None else
                                       ("xxh3" if choice == "auto" else choice))
        f.release()
    assert dec.pool.leases == 0


values = st.one_of(st.integers(-(2**64), 2**65), st.booleans(), st.none(), st.text(max_size=3),
                   st.floats(allow_nan=False), st.binary(max_size=3))
tables = st.one_of(values, st.lists(st.one_of(values, st.lists(values, max_size=7)), max_size=5))


@PROPS
@given(tables, st.binary(max_size=64))
def test_a_garbage_table_is_a_frame_error_or_adds_up(table: Any, payload: bytes) -> None:
    try:
        got, _bad = unpack(table, memoryview(payload))
    except FrameError:
        return
    assert sum(g.nbytes for g in got) == len(payload) and len(got) == len(table)
