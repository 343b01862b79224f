"""The verification thread: verdicts on the loop, in submission order; nothing after close."""

from __future__ import annotations

import asyncio
import functools
import threading

from transport.checksum import checksum_of
from transport.verify import Verifier


async def test_verdicts_arrive_on_the_loop_in_submission_order() -> None:
    v = Verifier()
    payloads = [memoryview(bytes([i]) * (300_000 + i)) for i in range(6)]
    verdicts: list[tuple[int, bool, bool]] = []
    all_in = asyncio.Event()

    def done(i: int, intact: bool) -> None:
        verdicts.append((i, intact, threading.current_thread() is threading.main_thread()))
        if len(verdicts) == len(payloads):
            all_in.set()

    for i, p in enumerate(payloads):
        expected = checksum_of("xxh3", p) ^ (i % 2)  # odd ones do not match
        v.submit("xxh3", p, expected, functools.partial(done, i))
    await all_in.wait()
    assert verdicts == [(i, i % 2 == 0, True) for i in range(6)]
    v.close()


async def test_a_closed_verifier_drops_pending_checks() -> None:
    v = Verifier()
    v.close()
    v.close()  # idempotent
    try:
        v.submit("xxh3", memoryview(b"x"), 0, lambda ok: None)
    except RuntimeError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("submit after close must fail")


async def test_checksums_computed_on_the_thread_match_the_inline_ones() -> None:
    v = Verifier()
    payloads = [memoryview(bytes(range(256)) * (1200 + i)) for i in range(3)]
    sums = [v.checksum("xxh3", p) for p in payloads]
    assert [await s for s in sums] == [checksum_of("xxh3", p) for p in payloads]
    v.close()
