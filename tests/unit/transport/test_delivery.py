"""Deliveries handed to receivers: copying blocks out into the receiver's own buffers."""

from __future__ import annotations

import numpy as np
import pytest

from transport.base import Block, BlockId, Delivery


class Lease:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_detach_into_copies_bytes_keeps_identity_and_releases() -> None:
    src = [np.arange(i, i + 64, dtype=np.uint8) for i in range(3)]
    blocks = [Block.of(10 + i, s, (i, i + 2)).with_checksum() for i, s in enumerate(src)]
    lease = Lease()
    dst = [np.zeros(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8), np.zeros(100, dtype=np.uint8)]
    out = Delivery(blocks, [lease]).detach(into=dst)
    assert lease.released == 1
    for i, (b, got) in enumerate(zip(blocks, out, strict=True)):
        assert (got.block_id, got.layers, got.checksum, got.checksum_algo) == (b.block_id, b.layers, b.checksum,
                                                                                b.checksum_algo)
        assert bytes(got.payload) == bytes(src[i]) and got.intact()
    assert bytes(dst[2][:64]) == bytes(src[2]) and not dst[2][64:].any()  # a larger slot keeps its tail


def test_detach_into_refuses_small_or_read_only_destinations() -> None:
    block = Block.of(1, bytes(64))
    with pytest.raises(ValueError, match="smaller"):
        Delivery([block]).detach(into=[bytearray(63)])
    with pytest.raises(ValueError, match="read-only"):
        Delivery([block]).detach(into=[bytes(64)])


def test_over_keeps_everything_but_the_buffer() -> None:
    b = Block(BlockId(-5), memoryview(b"abcd"), (2, 3), 7, "crc32")
    other = memoryview(bytearray(b"abcd"))
    c = b.over(other)
    assert c == Block(BlockId(-5), other, (2, 3), 7, "crc32") and c.payload is other
    with pytest.raises(AttributeError):
        c.layers = (0, 1)  # type: ignore[misc]  # still frozen


def test_detached_blocks_read_as_a_sequence_over_the_receivers_buffers() -> None:
    src = [np.full(32, i, dtype=np.uint8) for i in range(4)]
    blocks = [Block.of(i, s, (0, 4)) for i, s in enumerate(src)]
    dst = [np.zeros(8, dtype=np.float32) for _ in range(4)]  # another format: copied through the checked path
    out = Delivery(blocks).detach(into=dst)
    assert len(out) == 4 and [b.block_id for b in out[1:3]] == [1, 2] and out[-1].block_id == 3
    assert [bytes(b.payload) for b in out] == [bytes(s) for s in src]
    assert np.shares_memory(np.frombuffer(out[2].payload, np.uint8), dst[2])
    with pytest.raises(ValueError, match="2 destination buffers for 4 blocks"):
        Delivery(blocks).detach(into=dst[:2])


def test_unshaped_record_is_the_frozen_record_its_fields_say() -> None:
    """``TransferRecord.unshaped`` builds through a layout twin (``_UnshapedRecord``): the result must be an
    ordinary, frozen ``TransferRecord``, equal (and hashing equal) to the one the dataclass builds."""
    import dataclasses
    import pickle

    from transport.base import RequestId, Site, TransferRecord

    site = Site("n1", "r1")
    fast = TransferRecord.unshaped(RequestId("r"), "push", "tcp", site, 3, 4096, 1.5, 0.25, 0.125)
    slow = TransferRecord(RequestId("r"), "push", "tcp", site, 3, 4096, 4096.0, 1.5, 0.25, 0.125)
    assert type(fast) is TransferRecord
    assert fast == slow and hash(fast) == hash(slow)
    assert isinstance(fast.emulated_bytes, float) and fast.link is None and fast.real_bottleneck is False
    assert fast.lag_ms == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.wall_ms = 1.0  # type: ignore[misc]
    assert dataclasses.replace(fast, wall_ms=2.0).wall_ms == 2.0
    assert pickle.loads(pickle.dumps(fast)) == slow  # records travel between actors
