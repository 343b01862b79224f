"""Fuzzing the frame decoder: random and mutated byte streams give frames or FrameError, never anything
else, never a hang, and never an allocation beyond the declared caps."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.base import FrameError
from transport.checksum import checksum_of
from transport.frame import FrameDecoder, FrameType, Limits, encode_bytes
from transport.pool import BufferPool

LIMITS = Limits(max_meta_bytes=1024, max_payload=64 * 1024)
POOL_BYTES = 256 * 1024
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

metas = st.dictionaries(st.sampled_from(["t", "i", "b", "r", "n", "l", "x"]),
                        st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.booleans(),
                                  st.lists(st.integers(0, 100), max_size=3)), max_size=5)
frames = st.lists(st.tuples(st.sampled_from(list(FrameType)), metas, st.binary(max_size=5000),
                            st.sampled_from(["xxh3", "sum64", "crc32"])), min_size=1, max_size=6)


def decode(stream: bytes, cuts: list[int]) -> tuple[list[tuple[bool, bytes, int, str]], BufferPool]:
    """Feed ``stream`` split at ``cuts`` as a receiver would, releasing each frame once read.

    Returns (intact, payload, declared checksum, algorithm) of the frames decoded before any FrameError.
    """
    pool = BufferPool(POOL_BYTES)
    dec = FrameDecoder(pool, LIMITS)
    out: list[tuple[bool, bytes, int, str]] = []
    pieces, last = [], 0
    for c in sorted(set(cuts)):
        if 0 < c < len(stream):
            pieces.append(stream[last:c])
            last = c
    pieces.append(stream[last:])
    try:
        for p in pieces:
            for f in dec.feed(p):
                out.append((f.intact, bytes(f.payload), f.checksum, f.algo))
                f.release()
            assert pool.allocated_bytes <= POOL_BYTES
    except FrameError:
        pass
    dec.close()
    return out, pool


@FUZZ
@given(frames, st.lists(st.integers(0, 40_000), max_size=8))
def test_valid_streams_roundtrip_in_any_chunking(spec: list, cuts: list[int]) -> None:
    stream = b"".join(encode_bytes(t, m, p, algo=a) for t, m, p, a in spec)
    pool = BufferPool(POOL_BYTES)
    dec = FrameDecoder(pool, LIMITS)
    got = []
    last = 0
    for c in [*sorted(set(cuts)), len(stream)]:
        if last <= c <= len(stream):
            for f in dec.feed(stream[last:c]):
                got.append((f.type, f.meta, bytes(f.payload), f.algo, f.intact))
                f.release()
            last = c
    assert got == [(t, m, p, a, True) for t, m, p, a in spec]
    assert pool.leases == 0


@FUZZ
@given(st.binary(max_size=4000), st.lists(st.integers(0, 4000), max_size=6))
def test_random_bytes_give_only_frame_errors(junk: bytes, cuts: list[int]) -> None:
    _, pool = decode(junk, cuts)
    assert pool.leases == 0


@FUZZ
@given(frames, st.data())
def test_mutated_streams_give_frames_or_frame_errors(spec: list, data: st.DataObject) -> None:
    stream = bytearray(b"".join(encode_bytes(t, m, p, algo=a) for t, m, p, a in spec))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate", "splice"]))
        pos = data.draw(st.integers(0, max(0, len(stream) - 1)))
        if op == "flip" and stream:
            stream[pos] ^= data.draw(st.integers(1, 255))
        elif op == "insert":
            stream[pos:pos] = data.draw(st.binary(min_size=1, max_size=64))
        elif op == "delete":
            del stream[pos:pos + data.draw(st.integers(1, 64))]
        elif op == "truncate":
            del stream[pos:]
        else:
            stream[pos:pos] = stream[: data.draw(st.integers(0, 64))]
    out, pool = decode(bytes(stream), data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    for intact, payload, declared, algo in out:
        # a frame flagged intact really carries the bytes its header's checksum declares
        assert not intact or not payload or checksum_of(algo, payload) == declared  # type: ignore[arg-type]
    assert pool.leases == 0


@FUZZ
@given(st.integers(LIMITS.max_payload + 1, 2**64 - 1), st.integers(0, 2**32 - 1))
def test_declared_lengths_are_capped_before_allocating(payload_len: int, meta_len: int) -> None:
    import struct

    header = struct.pack("<4sBBBBIQQI", b"KVMF", 1, 1, 1, 0, min(meta_len, LIMITS.max_meta_bytes), payload_len, 0, 0)
    pool = BufferPool(POOL_BYTES)
    with pytest.raises(FrameError):
        FrameDecoder(pool, LIMITS).feed(header + bytes(64))
    assert pool.allocations == 0
