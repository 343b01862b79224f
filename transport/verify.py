"""Payload checksums off the event loop's thread, for endpoints whose loop also moves the bytes.

Why: a receiver moves bytes on its event loop's thread (a UCX worker progressed there, a TCP socket
read there), and checking a payload's XXH3 there costs 31-43 us per MiB, time in which nothing else is
received. ``xxhash`` releases the GIL while it hashes (measured: a Python loop kept running on the
main thread while another hashed 256 MiB), so a check run on another thread overlaps the next
receive wherever a core is free. Every byte is still verified before its frame is delivered; only
where the check runs changes.

:class:`Verifier` is one worker thread fed by a queue. ``submit`` hands it a payload view, the
checksum algorithm and the expected value; the thread computes the checksum and calls
``done(intact)`` on the event loop (``call_soon_threadsafe``), in submission order. ``checksum``
computes a checksum a sender lacks the same way, as a future (a push starts its large blocks'
checksums at once, so each is hashed while the loop writes the blocks before it).

Measured (``bench/transport_ucx_sweep.py``, locked, host load 4.3 from other work, so every figure
low): ucx over tcp 3.8 GB/s with the thread against 1.3 with checksums on the loop; over sm 2.0
against 1.7; tcp (``bench/transport.py``) 1.9 against 2.1, within that run's noise. A later A/B (same
run, alternating, receiver CPU per MiB) found the opposite for ucx, and ucx now keeps its checksums on
its worker's thread by default (see :mod:`transport.ucx`): the verdict came back 0.76-1.0 ms after its
payload landed (the thread waits for the GIL a spinning loop holds), and a push's window stayed held
that long.

Invariants: the caller keeps the payload's buffer unchanged and alive until ``done`` ran (a receiver
that gives up on the frame meanwhile must not recycle the buffer: ``Lease.discard``); ``done`` runs
at most once per submission, on the loop, never on the thread.

Failure behaviour: after ``close`` (or once the loop closed) pending checks are dropped and their
``done`` never runs; the caller, closing too, drops what it waited for. A checksum function that
raises reports the payload as not intact (the frame then fails with ``IntegrityError``).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable

from transport.checksum import ChecksumName, checksum_of

VERIFY_THREAD_MIN = 256 * 1024
"""Payloads at least this large are worth a hand-off to the thread (one costs a few microseconds, about
what hashing 64 KiB costs); smaller ones are verified inline."""

Verdict = Callable[[bool], None]
Sum = Callable[[int | None], None]
"""Called on the loop with a payload's checksum (None when the checksum function failed)."""


class Verifier:
    """A checksum thread for one event loop (see the module docstring).

    It also computes checksums a sender lacks (``checksum``): a push's large blocks are hashed here
    while the loop writes the blocks before them.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue[tuple[ChecksumName, memoryview, Sum] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, algo: ChecksumName, payload: memoryview, expected: int, done: Verdict) -> None:
        """Check ``payload`` on the thread; ``done(intact)`` runs on the running loop (the one of the first
        submission: a verifier serves one loop) afterwards."""
        self._put(algo, payload, functools.partial(_judge, expected, done))

    def checksum(self, algo: ChecksumName, payload: memoryview) -> asyncio.Future[int]:
        """``payload``'s checksum under ``algo``, computed on the thread."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._put(algo, payload, functools.partial(_resolve, fut))
        return fut

    def _put(self, algo: ChecksumName, payload: memoryview, done: Sum) -> None:
        if self._closed:
            raise RuntimeError("verifier closed")
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._work, name="kvmesh-verify", daemon=True)
            self._thread.start()
        self._queue.put((algo, payload, done))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._closed:
                return
            algo, payload, done = item
            value: int | None
            try:
                value = checksum_of(algo, payload)
            except Exception:
                value = None
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(done, value)
            except RuntimeError:  # the loop closed: nobody waits any more
                return

    def close(self) -> None:
        """Stop the thread after the check in progress; pending checks are dropped."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)


def _judge(expected: int, done: Verdict, value: int | None) -> None:
    done(value == expected)


def _resolve(fut: asyncio.Future[int], value: int | None) -> None:
    if fut.done():  # its push gave up meanwhile
        return
    if value is None:
        fut.set_exception(ValueError("the checksum function failed on this payload"))
    else:
        fut.set_result(value)
