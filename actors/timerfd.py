"""A Linux timerfd as the event loop's wake-up at a step deadline: one precise wake-up, no thread, no polling.

The loop's own timers wake up to a millisecond late (uvloop/libuv keep time and timeouts in whole
milliseconds; asyncio's epoll rounds its timeout up to one), which is why the clock covers the last
millisecond another way. A timerfd armed at the absolute deadline on ``CLOCK_MONOTONIC`` (the clock
``time.monotonic`` reads on Linux) becomes readable at that instant, to the kernel's timer slack (50 us by
default), and the loop, registered as its reader, wakes from ``epoll_wait`` then: one wake-up of the loop's
own thread per deadline, where the ``thread`` waker needs two (its helper thread, which then needs the GIL
to post ``call_soon_threadsafe``, then the loop) and ``spin`` keeps the loop turning for the last millisecond.

Invariants: at most one deadline is armed (``set`` replaces it); a readiness with nothing to read (a
deadline replaced after it expired) calls nothing; ``stop`` unregisters and closes the descriptor.
Failure behaviour: where timerfd is missing (not Linux, no libc symbol) ``available()`` is False and
``TimerFdWaker`` raises ``OSError``; the clock refuses the ``timerfd`` waker there with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create, libc.timerfd_settime  # noqa: B018 (present, or AttributeError)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def available() -> bool:
    """Whether this host has timerfd (Linux)."""
    return _LIBC is not None


class TimerFdWaker:
    """Calls ``fire`` on ``loop`` when ``time.monotonic()`` reaches the deadline last ``set`` (see the module)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[], None]) -> None:
        if _LIBC is None:
            raise OSError("timerfd is not available on this host (Linux only): use the thread or spin waker")
        fd = _LIBC.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd: int | None = fd
        self.loop = loop
        self.fire = fire
        self._spec = _Itimerspec()
        loop.add_reader(fd, self._ready)

    def set(self, due: float) -> None:
        """Wake the loop at monotonic time ``due`` (seconds); a deadline already past wakes it at once."""
        if self.fd is None or _LIBC is None:
            return
        sec = int(due)
        nsec = min(999_999_999, max(0, int((due - sec) * 1e9)))
        if sec <= 0 and nsec == 0:
            nsec = 1  # an all-zero value would disarm the timer instead
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = sec, nsec
        if _LIBC.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def _ready(self) -> None:
        if self.fd is None:
            return
        try:
            os.read(self.fd, 8)  # the expiry count; reading re-arms readiness
        except BlockingIOError:
            return  # re-armed after it expired: nothing is due
        self.fire()

    def stop(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self.loop.remove_reader(fd)
        os.close(fd)
