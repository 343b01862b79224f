"""The UCX worker the ucx backend runs on: libucxx (ucxx's Cython layer) progressed on the event loop.

Why (measured; see ``bench/transport.py``): ucxx's asyncio layer progresses its worker in a thread
and awaits each request by yielding to the loop until it completes; on a small host that busy loop
and the progress thread fight over the cores and the GIL (0.3-0.6 GB/s for 1 MiB messages). Each
transport here owns a UCX context and worker and :class:`UcxWorker` progresses it on the event loop:
it spins (``progress`` then yield) while requests complete, and after ``SPIN_S`` without a completion
it arms the worker and sleeps on its event descriptor (woken by UCX, by a new request, or after
``IDLE_POLL_S``). An idle transport costs nothing; a busy one copies at memory speed on the loop's
own core.

A refused arm (UCX says events are pending, typically the previous wake-up's signal) progresses them
and arms again at once, without spinning another ``SPIN_S``: in a request/answer exchange whose
answers come later than ``SPIN_S`` (each side then sleeps between messages) that second spin delayed
every message. ``bench/transport_ucx_profile.py``, locked, same host state (load 1.5), 4 KiB pushes
over sm: p50 1201-1236 us with the second spin (four runs), 600-785 us without (eight runs); a bulk
run moved as fast as before (``bench/transport.py --parts ucx``: kvmesh 0.67x the bare loop over sm,
0.49x over tcp, against 0.54x and 0.53x before, both contended).

An idle spin (one whose progress found nothing) calls ``sched_yield`` before it turns the loop again: a
spinning loop then lends its core to whatever else is runnable there (the peer's loop, another process)
and takes it back at once when nothing is. On this two-core host a sender and a receiver each spin
while the other works, and other processes share the cores; a spin that kept its core delayed the very
peer it waited for. Locked A/B, same run, host under other work (direction only; ``/tmp`` harness, 64
MiB of 4 x 1 MiB pushes alternating with 4 KiB pushes, ``SPIN_S`` 200 us), without -> with the yield:
sm median 1.30 -> 2.00 and 1.67 -> 1.96 GB/s, receiver thread 573 -> 454 and 691 -> 506 us of CPU per
MiB, 4 KiB push p50 833 -> 425 us; tcp 0.66 -> 0.83 and 0.70 -> 0.92 GB/s, 927 -> 727 and 1101 -> 833
us/MiB, 4 KiB p50 751 -> 399 us. A shorter spin without the yield (50 us) recovered only part of it
(sm 1.53, tcp 0.76 GB/s), a longer one (1 ms) lost more (sm 1.14, tcp 0.55).

Completions are reaped after every ``progress_once`` step that made progress, not once UCX has nothing
left: with several payload receives posted, draining them all first let each 1 MiB copy push the
previous one out of the 1 MiB L2 before its callback hashed it. Receiver thread, ``xxh3`` of a 1 MiB
payload: 92 -> 58 us (one run each, host loaded). Locked A/B, alternated, 64 MiB of 1 MiB blocks, kvmesh
/ bare loop median GB/s, load 3-7 (direction only), with the other cuts of that commit (tags and control
buffers' ``Array`` made once): sm 0.48, 0.40 -> 0.54, 0.48; tcp 0.59, 0.55 -> 0.58, 0.67.

A sleep is one future, the fd's reader and a timer handle (it was ``wait_for`` over ``shield``: a task and
two more futures per sleep, on both sides of every 4 KiB push). ``bench/transport_ucx_profile.py
--quick``, locked, alternated with the code before, load 4-5 (direction only): 4 KiB push p50 sm 495,
395 -> 442, 347 us; tcp 559, 407 -> 467, 468 us.

UCX's defaults, not ucxx's GPU-oriented ones: importing ucxx sets ``UCX_MAX_RNDV_RAILS=1``,
``UCX_RNDV_THRESH=8192`` and ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` in the environment; where those are
ucxx's values (not the user's) the context is created with UCX's own defaults instead (:func:`ucx_config`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from transport.verify import VERIFY_THREAD_MIN, Verifier

log = logging.getLogger(__name__)

SPIN_S = 200e-6
"""How long the progress loop keeps spinning after the last completion before it sleeps on the worker's fd."""
IDLE_YIELD = True
"""An idle spin (progress found nothing) gives the core up (``sched_yield``) before the loop turns again."""
IDLE_POLL_S = 0.05
"""An idle worker is progressed at least this often even without an event (a missed wake-up cannot stall it)."""
# What importing ucxx puts in the environment (its GPU-oriented defaults), and UCX's own defaults.
_UCXX_ENV = {"UCX_MAX_RNDV_RAILS": "1", "UCX_RNDV_THRESH": "8192", "UCX_RNDV_FRAG_MEM_TYPE": "cuda"}
_UCX_DEFAULTS = {"MAX_RNDV_RAILS": "2", "RNDV_THRESH": "auto", "RNDV_FRAG_MEM_TYPE": "host"}


def _ucxx() -> Any:
    """libucxx (ucxx's Cython layer), imported on first use."""
    try:
        import ucxx._lib.libucxx as lib
    except ImportError as e:
        raise RuntimeError("the 'ucx' transport backend needs ucxx: install the 'ucx' extra "
                           "(pip install -e '.[ucx]')") from e
    return lib


_Array: Any = None


def _array(buf: Any) -> Any:
    """A ucxx ``Array`` over ``buf`` (the class imported once: an import statement per request cost 0.7 us)."""
    global _Array
    if _Array is None:
        from ucxx._lib.arr import Array

        _Array = Array
    return _Array(buf)


def ucx_config() -> dict[str, str]:
    """Context options: UCX's defaults where the environment holds only what importing ucxx put there."""
    return {k: v for (env, ucxx_value), (k, v) in zip(_UCXX_ENV.items(), _UCX_DEFAULTS.items(), strict=True)
            if os.environ.get(env, ucxx_value) == ucxx_value}


Done = Callable[[BaseException | None], None]


def close_endpoint(ep: Any) -> None:
    """Close ``ep`` (cancelling its receives) unless it already closed: libucxx crashes closing one twice."""
    with contextlib.suppress(Exception):
        if ep.alive:
            ep.close()


class UcxWorker:
    """A UCX context and worker progressed on the running event loop (see the module docstring).

    Requests are posted with a completion callback, called on the loop (never inside UCX) with
    ``None`` or the request's error. Invariant: every posted request stays referenced (with its buffer)
    until its callback ran.

    Completions are found by polling (libucxx has no completion callback without its notifier thread),
    so the scan is kept short: requests queue per channel (sends or receives of one endpoint and tag,
    or worker-wide receives of one tag) and only each channel's oldest is polled; its callback runs,
    then the next one's, in posting order. Tag matching is first-in first-out within a channel, so a
    later request rarely completes first, and when it does its callback waits for the older one (it
    is never lost: a closed endpoint completes all of its requests, cancelled). The scan runs only
    after progress made events or a request was posted, not on every spin.

    ``close`` cancels nothing by itself: connections close their endpoints first (which cancels their
    receives), then the worker stops progressing.
    """

    def __init__(self, verifier: Verifier | None = None, verify_min: int = VERIFY_THREAD_MIN) -> None:
        lib = _ucxx()
        self.lib = lib
        self.loop = asyncio.get_running_loop()
        self.context = lib.UCXContext(ucx_config())
        self.worker = lib.UCXWorker(self.context, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self.address: bytes = self.worker.address.tobytes()
        self._fd: int = self.worker.epoll_file_descriptor
        self._channels: dict[tuple[Any, ...], collections.deque[tuple[Any, Done, Any]]] = {}
        self._tags: dict[int, Any] = {}
        self._outstanding = 0
        self._kick: asyncio.Future[str | None] | None = None
        self.woke_by = ""
        """How the last sleep ended: ``fd`` (UCX signalled), ``post`` (a request was posted), ``idle_poll``."""
        self._fresh = False
        """A request was posted since the last scan for completions."""
        self._completed = False
        """A request completed in this turn of the progress loop."""
        self._closed = False
        self._task = self.loop.create_task(self._run())
        self.spins = 0
        self.sleeps = 0
        self.verifier = verifier
        """Checks received payloads of at least ``verify_min`` bytes off the loop's thread (None: none; its
        owner, the transport, closes it)."""
        self.verify_min = verify_min

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def _add(self, channel: tuple[Any, ...], req: Any, done: Done, keep: Any) -> None:
        q = self._channels.get(channel)
        if q is None:
            q = self._channels[channel] = collections.deque()
        q.append((req, done, keep))
        self._outstanding += 1
        self._fresh = True  # it may have completed as it was posted (an eager send), without progress
        if self._kick is not None and not self._kick.done():
            self._kick.set_result(None)

    def _tag(self, tag: int) -> Any:
        """The ``UCXXTag`` of ``tag``, made once (a connection posts on four tags, thousands of times)."""
        t = self._tags.get(tag)
        if t is None:
            t = self._tags[tag] = self.lib.UCXXTag(tag)
        return t

    def send(self, ep: Any, buf: Any, tag: int, done: Done, arr: Any = None) -> None:
        """Send ``buf`` on ``ep``; ``arr``: a ucxx ``Array`` over ``buf`` already made (a reused buffer's)."""
        if arr is None:
            arr = _array(buf)
        self._add(("s", id(ep), tag), ep.tag_send(arr, self._tag(tag)), done, (arr, buf))

    def recv(self, ep: Any, buf: Any, tag: int, done: Done, arr: Any = None) -> None:
        """Receive into ``buf`` on ``ep`` (closing ``ep`` cancels it); ``arr`` as for :meth:`send`."""
        if arr is None:
            arr = _array(buf)
        self._add(("r", id(ep), tag), ep.tag_recv(arr, self._tag(tag)), done, (arr, buf))

    def recv_any(self, buf: Any, tag: int, done: Done) -> None:
        """Receive from any peer on this worker (hellos)."""
        arr = _array(buf)
        self._add(("a", tag), self.worker.tag_recv(arr, self._tag(tag)), done, (arr, buf))

    @staticmethod
    def array(buf: Any) -> Any:
        """A ucxx ``Array`` over ``buf``, for a buffer posted many times (pass it as ``arr``)."""
        return _array(buf)

    async def wait_send(self, ep: Any, buf: Any, tag: int) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()

        def done(exc: BaseException | None) -> None:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

        self.send(ep, buf, tag, done)
        await fut

    def endpoint(self, worker_address: bytes, error_handling: bool) -> Any:
        lib = self.lib
        return lib.UCXEndpoint.create_from_worker_address(
            self.worker, lib.UCXAddress.create_from_buffer(worker_address), error_handling)

    def _reap(self) -> bool:
        finished: list[tuple[Done, BaseException | None]] = []
        emptied: list[tuple[Any, ...]] = []
        for channel, q in self._channels.items():
            while q and q[0][0].completed:
                req, done, _keep = q.popleft()
                exc: BaseException | None = None
                try:
                    req.check_error()
                except Exception as e:
                    exc = e
                finished.append((done, exc))
            if not q:
                emptied.append(channel)
        for channel in emptied:
            del self._channels[channel]
        self._outstanding -= len(finished)
        if finished:
            self._completed = True
        for done, exc in finished:
            try:
                done(exc)
            except Exception:
                log.exception("UCX completion callback failed")
        return bool(finished)

    def _progress(self) -> bool:
        """Progress UCX until it has nothing left to do (what ``progress()`` does), telling whether anything
        happened; completions are reaped after each step that made progress, so a payload's callback (its
        checksum) reads it while the copy that just landed it is still in the CPU's cache."""
        progressed = False
        progress_once = self.worker.progress_once
        while progress_once():
            progressed = True
            if self._outstanding:
                self._reap()
        return progressed

    async def _run(self) -> None:
        quiet_since = time.perf_counter()
        while not self._closed:
            progressed = self._fresh
            self._fresh = False
            self._completed = False
            progressed = self._progress() or progressed
            if progressed and self._outstanding:  # no event, no completion: skip the scan
                self._reap()  # requests that completed as they were posted (an eager send), without an event
            if self._completed:
                quiet_since = time.perf_counter()
            elif time.perf_counter() - quiet_since > SPIN_S and await self._sleep():
                quiet_since = time.perf_counter()
                continue
            # a refused sleep (events pending) progresses them now and arms again, without another spin
            self.spins += 1
            if IDLE_YIELD and not progressed:
                os.sched_yield()
            await asyncio.sleep(0)

    async def _sleep(self) -> bool:
        """Arm the worker and wait for its fd, a new request, or the idle poll (whichever comes first);
        False, at once, when the worker refused to arm (events are pending). How the wait ended is left in
        ``woke_by`` (``fd``, ``post`` or ``idle_poll``).

        One future, a reader and a timer handle per sleep (not ``wait_for`` over ``shield``, which made a
        task and two more futures): a sleep and its wake-up sit on every 4 KiB push's path, both sides.
        """
        if not self.worker.arm():
            return False
        self.sleeps += 1
        loop = self.loop
        kick: asyncio.Future[str | None] = loop.create_future()
        self._kick = kick

        def readable() -> None:
            if not kick.done():
                kick.set_result("fd")

        def idle() -> None:
            if not kick.done():
                kick.set_result("idle_poll")

        loop.add_reader(self._fd, readable)
        timer = loop.call_later(IDLE_POLL_S, idle)
        try:
            self.woke_by = await kick or "post"
        finally:
            timer.cancel()
            loop.remove_reader(self._fd)
            self._kick = None
        return True

    async def close(self) -> None:
        if self._closed:
            return
        for _ in range(100):  # let cancellations of closed endpoints' receives come back
            self.worker.progress()
            self._reap()
            if not self._outstanding:
                break
            await asyncio.sleep(0)
        self._closed = True
        if self._kick is not None and not self._kick.done():
            self._kick.set_result(None)
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._channels.clear()
        self._outstanding = 0


def ucx_available() -> str | None:
    """None when ucxx imports here, else why not (for tests and benchmarks that skip)."""
    try:
        _ucxx()
    except Exception as e:
        return f"{e} ({e.__cause__})" if e.__cause__ else str(e)
    return None
