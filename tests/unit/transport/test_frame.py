"""The frame codec, driven by replayed bytes (no sockets)."""

from __future__ import annotations

import struct

import pytest

from transport.base import FrameError
from transport.checksum import ChecksumName, checksum_of
from transport.frame import (
    HEADER_SIZE,
    MAGIC,
    SMALL,
    SMALL_META_SIZE,
    STAGE_READ,
    FrameDecoder,
    FrameType,
    Limits,
    encode_ack,
    encode_bytes,
    encode_small_push,
)
from transport.pool import BufferPool


def decoder(pool_bytes: int = 8 << 20, max_payload: int = 4 << 20) -> FrameDecoder:
    return FrameDecoder(BufferPool(pool_bytes), Limits(max_meta_bytes=4096, max_payload=max_payload))


def feed_in_chunks(dec: FrameDecoder, data: bytes, chunk: int) -> list:
    out = []
    for i in range(0, len(data), chunk):
        out.extend(dec.feed(data[i:i + chunk]))
    return out


@pytest.mark.parametrize("chunk", [1, 7, 32, 4096, 1 << 20])
def test_roundtrip_any_chunking(chunk: int) -> None:
    big = 300_000 if chunk >= 32 else 3000  # byte-by-byte feeding is slow in Python: keep it small
    payloads = [b"", b"x", bytes(range(256)) * (big // 300), bytes(big)]
    stream = b"".join(encode_bytes(FrameType.PUSH_DATA, {"t": i, "i": 0, "b": -5, "l": [0, 32]}, p)
                      for i, p in enumerate(payloads))
    dec = decoder()
    frames = feed_in_chunks(dec, stream, chunk)
    assert [f.meta["t"] for f in frames] == [0, 1, 2, 3]
    for f, p in zip(frames, payloads, strict=True):
        assert f.type == FrameType.PUSH_DATA and f.intact and bytes(f.payload) == p
        assert f.meta["l"] == [0, 32] and f.meta["b"] == -5
        f.release()
    assert dec.pool.leases == 0


@pytest.mark.parametrize("algo", ["xxh3", "sum64", "crc32"])
def test_every_checksum_algorithm_stays_readable(algo: ChecksumName) -> None:
    dec = decoder()
    [f] = dec.feed(encode_bytes(FrameType.PULL_DATA, {"t": 1}, b"abc" * 100, algo=algo))
    assert f.algo == algo and f.intact
    f.release()


@pytest.mark.parametrize("algo", ["xxh3", "sum64", "crc32"])
def test_a_corrupt_payload_is_detected_under_every_algorithm(algo: ChecksumName) -> None:
    dec = decoder()
    wire = bytearray(encode_bytes(FrameType.PUSH_DATA, {"t": 1}, bytes(range(256)) * 40, algo=algo))
    wire[-1000] ^= 0x01
    [f] = dec.feed(wire)
    assert f.algo == algo and not f.intact
    f.release()


def test_senders_default_to_xxh3() -> None:
    [f] = decoder().feed(encode_bytes(FrameType.PUSH_DATA, {"t": 1}, b"x" * 64))
    assert f.algo == "xxh3" and f.intact
    f.release()


def test_steady_state_allocates_nothing_per_frame() -> None:
    dec = decoder()
    frame = encode_bytes(FrameType.PUSH_DATA, {"t": 1}, bytes(1 << 20))
    for _ in range(3):
        for f in dec.feed(frame):
            f.release()
    allocations = dec.pool.allocations
    for _ in range(50):
        for f in dec.feed(frame):
            f.release()
    assert dec.pool.allocations == allocations == 1


def test_a_backlogged_socket_reads_large_payloads_straight_into_their_buffers() -> None:
    """A socket with a backlog fills every buffer it is handed: of each 1 MiB payload at most ``STAGE_READ``
    bytes (read with its header) go through the staging area and are copied out; the rest is read into
    the payload's own pool buffer."""
    payload = bytes(range(256)) * 4096
    wire = encode_bytes(FrameType.PUSH_DATA, {"t": 1}, payload) * 3
    dec = decoder()
    reads: list[tuple[object, int]] = []
    frames = []
    pos = 0
    while pos < len(wire):
        view = dec.get_buffer(-1)
        k = min(view.nbytes, len(wire) - pos)
        view[:k] = wire[pos:pos + k]
        pos += k
        reads.append((view.obj, k))
        frames.extend(dec.buffer_updated(k))
    assert len(frames) == 3 and all(f.intact and bytes(f.payload) == payload for f in frames)
    buffers = [f.lease.buffer for f in frames if f.lease is not None]
    staged = sum(k for obj, k in reads if not any(obj is b for b in buffers))
    assert staged <= 3 * STAGE_READ
    for f in frames:
        f.release()


@pytest.mark.parametrize("flip", [100, 70_000, (1 << 20) - 1])
@pytest.mark.parametrize("chunk", [4096, 1 << 21])
def test_a_large_payload_hashed_as_it_lands_is_still_checked_whole(flip: int, chunk: int) -> None:
    """A flipped byte anywhere in a 1 MiB xxh3 payload (read with its header, through staging, or straight
    into its buffer) fails only its own frame; the next one decodes intact."""
    payload = bytes(range(256)) * 4096
    frame = encode_bytes(FrameType.PUSH_DATA, {"t": 1}, payload)
    bad = bytearray(frame)
    bad[len(frame) - len(payload) + flip] ^= 0x10
    frames = feed_in_chunks(decoder(), bytes(bad) + frame, chunk)
    assert [f.intact for f in frames] == [False, True]
    assert bytes(frames[1].payload) == payload
    for f in frames:
        f.release()


def test_corrupt_payload_is_flagged_and_stream_continues() -> None:
    good = encode_bytes(FrameType.PUSH_DATA, {"t": 1}, b"hello world" * 10)
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    dec = decoder()
    frames = dec.feed(bytes(bad) + good)
    assert [f.intact for f in frames] == [False, True]
    for f in frames:
        f.release()


def _header(**over: int) -> bytes:
    fields = {"magic": 0, "version": 1, "type": 1, "algo": 1, "flags": 0, "meta": 0, "payload": 0}
    fields.update(over)
    magic = MAGIC if not fields["magic"] else b"XXXX"
    return struct.pack("<4sBBBBIQQI", magic, fields["version"], fields["type"], fields["algo"], fields["flags"],
                       fields["meta"], fields["payload"], 0, 0)


@pytest.mark.parametrize(("over", "message"), [
    ({"magic": 1}, "magic"),
    ({"version": 9}, "version 9"),
    ({"type": 99}, "unknown frame type"),
    ({"algo": 7}, "checksum algorithm"),
    ({"flags": 1}, "flags"),  # compact on a PUSH_DATA frame
    ({"flags": 2}, "flags"),
    ({"flags": 1, "type": 4, "meta": 3}, "compact is for an ACK"),
    ({"meta": 1 << 30}, "metadata length"),
    ({"payload": 1 << 60}, "payload length"),
    ({}, "header checksum"),
])
def test_bad_headers_raise_frame_error_before_allocating(over: dict[str, int], message: str) -> None:
    dec = decoder()
    with pytest.raises(FrameError, match=message):
        dec.feed(_header(**over))
    assert dec.pool.allocations == 0
    with pytest.raises(FrameError):  # a failed decoder stays failed
        dec.feed(b"more")


def test_metadata_must_be_a_msgpack_map() -> None:
    import zlib

    for meta in (b"\xc1", b"\x93\x01\x02\x03"):  # never-used byte; a list
        prefix = struct.pack("<4sBBBBIQQ", MAGIC, 1, 1, 1, 0, len(meta), 0, 0)
        frame = prefix + struct.pack("<I", zlib.crc32(meta, zlib.crc32(prefix))) + meta
        with pytest.raises(FrameError, match=r"msgpack|map"):
            decoder().feed(frame)


def test_pool_exhaustion_pauses_then_resumes() -> None:
    dec = decoder(pool_bytes=1 << 20, max_payload=1 << 20)
    frame = encode_bytes(FrameType.PUSH_DATA, {"t": 1}, bytes(600_000))
    [first] = dec.feed(frame)
    assert dec.feed(frame[: HEADER_SIZE + 20]) == []  # header and metadata only: the pool is full
    rest = frame[HEADER_SIZE + 20:]
    assert dec.feed(rest[:10]) == []  # staged meanwhile
    assert dec.waiting_for_buffer
    first.release()
    frames = dec.resume() + dec.feed(rest[10:])
    assert len(frames) == 1 and frames[0].intact
    frames[0].release()
    assert dec.pool.leases == 0


def test_close_releases_a_partial_payload() -> None:
    dec = decoder()
    frame = encode_bytes(FrameType.PUSH_DATA, {"t": 1}, bytes(200_000))
    assert dec.feed(frame[:100_000]) == []
    assert dec.pool.leases == 1
    dec.close()
    assert dec.pool.leases == 0


def test_compact_ack_decodes_as_a_success_answer_and_its_id_is_crc_checked() -> None:
    dec = decoder()
    stream = encode_ack(7) + encode_bytes(FrameType.ACK, {"t": 8, "ok": False, "e": "timeout", "m": "late"})
    stream += encode_ack(2**64 - 1)
    frames = feed_in_chunks(dec, stream, 5)
    assert [(f.type, f.meta) for f in frames] == [
        (FrameType.ACK, {"t": 7, "ok": True}), (FrameType.ACK, {"t": 8, "ok": False, "e": "timeout", "m": "late"}),
        (FrameType.ACK, {"t": 2**64 - 1, "ok": True})]
    assert len(encode_ack(7)) == HEADER_SIZE
    bad = bytearray(encode_ack(7))
    bad[20] ^= 1  # another transfer id under the same CRC
    with pytest.raises(FrameError, match="header checksum"):
        decoder().feed(bytes(bad))


def small_push(tid: int = 9, block_id: int = -3, layers: tuple[int, int] = (2, 5), rid: str = "réq",
               payload: bytes = b"kv" * 2048, x: float = 1e9) -> bytes:
    body = memoryview(payload)
    return encode_small_push(tid, block_id, layers, rid, x, body, checksum_of("xxh3", body), "xxh3") + payload


@pytest.mark.parametrize("chunk", [1, 5, 33, 4096, 1 << 20])
def test_small_push_decodes_as_a_checked_one_block_push(chunk: int) -> None:
    ids = [0, -3, -(2**63), 2**63, 2**64 - 1]
    stream = b"".join(small_push(tid=i, block_id=b, rid=f"r{i}", payload=bytes([i]) * (100 + i))
                      for i, b in enumerate(ids))
    stream += small_push(tid=7, rid="", payload=b"")
    frames = feed_in_chunks(decoder(), stream, chunk)
    assert [f.meta for f in frames] == [
        *({"t": i, "i": 0, "b": b, "l": [2, 5], "r": f"r{i}", "n": 1, "c": True, "x": 1e9} for i, b in enumerate(ids)),
        {"t": 7, "i": 0, "b": -3, "l": [2, 5], "r": "", "n": 1, "c": True, "x": 1e9}]
    for i, f in enumerate(frames[:-1]):
        assert f.type == FrameType.PUSH_DATA and f.checked and f.intact and bytes(f.payload) == bytes([i]) * (100 + i)
        f.release()
    assert frames[-1].checked and frames[-1].payload.nbytes == 0


def test_small_push_refuses_ids_beyond_its_layout() -> None:
    with pytest.raises(struct.error):
        small_push(layers=(0, 2**32))
    with pytest.raises(struct.error):
        small_push(tid=2**64)


def test_a_corrupt_small_push_payload_is_flagged_and_the_stream_continues() -> None:
    bad = bytearray(small_push())
    bad[-10] ^= 0x01
    frames = decoder().feed(bytes(bad) + small_push(tid=10))
    assert [(f.meta["t"], f.intact) for f in frames] == [(9, False), (10, True)]
    for f in frames:
        f.release()


def _small_with_meta(meta: bytes, ftype: int = FrameType.PUSH_DATA) -> bytes:
    import zlib

    prefix = struct.pack("<4sBBBBIQQ", MAGIC, 1, ftype, 3, SMALL, len(meta), 0, 0)
    return prefix + struct.pack("<I", zlib.crc32(meta, zlib.crc32(prefix))) + meta


FIXED = struct.Struct("<QQIIdB")


@pytest.mark.parametrize(("wire", "message"), [
    (_small_with_meta(FIXED.pack(1, 5, 0, 1, 0.0, 0)[:-1]), "small is for a PUSH_DATA"),  # short metadata
    (_small_with_meta(FIXED.pack(1, 5, 0, 1, 0.0, 0), FrameType.PUSH_END), "small is for a PUSH_DATA"),
    (_small_with_meta(FIXED.pack(1, 5, 0, 1, 0.0, 0), FrameType.ACK), "flags"),
    (_small_with_meta(FIXED.pack(1, 5, 3, 3, 0.0, 0)), "layer range"),
    (_small_with_meta(FIXED.pack(1, 5, 0, 1, 0.0, 2)), "sign byte"),
    (_small_with_meta(FIXED.pack(1, 5, 0, 1, 0.0, 1)), "sign byte"),  # negative, but below -2**63
    (_small_with_meta(FIXED.pack(1, 5, 0, 1, 0.0, 0) + b"\xff\xfe"), "UTF-8"),
    (small_push()[:40] + bytes([small_push()[40] ^ 1]) + small_push()[41:], "header checksum"),  # meta under the CRC
])
def test_malformed_small_pushes_raise_frame_error(wire: bytes, message: str) -> None:
    dec = decoder()
    with pytest.raises(FrameError, match=message):
        dec.feed(wire)
    assert dec.pool.leases == 0
    assert FIXED.size == SMALL_META_SIZE


def test_a_compact_ack_with_another_algorithm_id_still_decodes() -> None:
    """The decoder's shortcut matches the ACKs this side writes; other valid compact ACKs take the general path."""
    import zlib

    prefix = struct.pack("<4sBBBBIQQ", MAGIC, 1, FrameType.ACK, 1, 1, 0, 0, 42)
    [f] = decoder().feed(prefix + struct.pack("<I", zlib.crc32(prefix)))
    assert f.meta == {"t": 42, "ok": True}
