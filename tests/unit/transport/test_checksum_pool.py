"""Checksums, the receive buffer pool and the byte budget."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from transport.checksum import checksum_of, pick, sum64
from transport.endpoint import ByteBudget
from transport.pool import MIN_CLASS, BufferPool, size_class


def test_sum64_catches_every_single_byte_change() -> None:
    rng = np.random.default_rng(0)
    data = bytearray(rng.integers(0, 256, 4096 * 3 + 13, dtype=np.uint8).tobytes())
    ref = sum64(data)
    for pos in range(0, len(data), 7):
        for delta in (1, 128, 255):
            data[pos] ^= delta
            assert sum64(data) != ref, (pos, delta)
            data[pos] ^= delta
    assert sum64(data) == ref


def test_sum64_sees_length_and_chunk_order() -> None:
    zeros = bytes(10_000)
    assert sum64(zeros) != sum64(zeros[:-1]) != sum64(zeros[:-8])
    a, b = bytes(range(256)) * 16, bytes(reversed(range(256))) * 16  # two different 4 KiB chunks
    assert sum64(a + b) != sum64(b + a)
    assert sum64(b"") != sum64(b"\0")


def test_checksum_by_name() -> None:
    assert checksum_of("crc32", b"abc") == 0x352441C2
    assert checksum_of("sum64", memoryview(b"abc")) == sum64(b"abc")
    assert checksum_of("xxh3", b"") == 0x2D06800538D394C2  # XXH3-64 of the empty input, seed 0
    assert checksum_of("xxh3", b"abc") != checksum_of("xxh3", b"abd")
    assert pick("auto", 4096) == pick("auto", 1 << 20) == "xxh3"
    with pytest.raises(ValueError, match="unknown checksum"):
        checksum_of("md5", b"")  # type: ignore[arg-type]


def test_size_classes() -> None:
    assert size_class(0) == MIN_CLASS
    assert size_class(MIN_CLASS + 1) == 2 * MIN_CLASS
    assert size_class(1 << 20) == 1 << 20


def test_pool_reuses_buffers_and_counts_leases() -> None:
    pool = BufferPool(1 << 20)
    first = pool.acquire(100_000)
    assert first is not None and first.view.nbytes == 100_000
    first.release()
    first.release()  # idempotent
    for _ in range(100):
        lease = pool.acquire(100_000)
        assert lease is not None
        lease.release()
    assert pool.allocations == 1
    assert pool.leases == 0 and pool.in_use_bytes == 0
    with pytest.raises(ValueError):
        first.view.tobytes()  # a released lease's view is unusable


def test_pool_budget_and_eviction() -> None:
    pool = BufferPool(1 << 20)
    halves = [pool.acquire(1 << 19), pool.acquire(1 << 19)]
    assert all(h is not None for h in halves)
    assert pool.acquire(1) is None  # exhausted
    woken: list[int] = []
    remove = pool.on_release(lambda: woken.append(1))
    for h in halves:
        assert h is not None
        h.release()
    assert woken == [1, 1]
    remove()
    big = pool.acquire(1 << 20)  # evicts the two idle halves
    assert big is not None and pool.allocated_bytes == 1 << 20
    big.release()
    with pytest.raises(ValueError, match="capacity"):
        pool.acquire((1 << 20) + 1)


async def test_byte_budget_bounds_and_cancels_cleanly() -> None:
    budget = ByteBudget(100)
    await budget.acquire(60)
    waiter = asyncio.ensure_future(budget.acquire(60))
    await asyncio.sleep(0)
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.used == 60 and not budget._waiters
    second = asyncio.ensure_future(budget.acquire(60))
    budget.release(60)
    await second
    assert budget.used == 60
    budget.release(60)
    await budget.acquire(500)  # larger than the capacity: admitted alone
    assert budget.used == 500


async def test_byte_budget_try_acquire_never_jumps_the_queue() -> None:
    budget = ByteBudget(100)
    assert budget.try_acquire(60) and budget.used == 60
    assert not budget.try_acquire(60) and budget.used == 60  # no room: refused, nothing taken
    waiter = asyncio.ensure_future(budget.acquire(50))
    await asyncio.sleep(0)
    assert not budget.try_acquire(10)  # room, but someone waits first
    budget.release(60)
    await waiter
    assert budget.try_acquire(50) and budget.used == 100
