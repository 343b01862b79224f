"""The request slice the Linux scheduler gives this process's threads (EEVDF, Linux 6.12 and later).

Why. On a host shared by the engines, the router and the load generator (2 cores, ~4 busy processes), an
engine whose step deadline passes is woken, then waits in the run queue until the running task's slice ends:
the fair scheduler's default slice is about 3 ms (scaled with the core count), which shows as step lag. Since
6.12 a thread may ask for a shorter slice (``sched_setattr``'s ``sched_runtime`` for ``SCHED_OTHER``, from
0.1 to 100 ms, no privilege needed): its virtual deadlines come sooner, so when it wakes it preempts the task
running (``PREEMPT_SHORT``) instead of waiting out that task's slice. Its share of the CPU does not change
(that is what the niceness is for): it gets the same time in shorter, more prompt pieces.

How. ``set_request_slice`` reads each thread's attributes (``sched_getattr``), keeps its policy, niceness and
flags, and sets the slice (``sched_setattr``). Threads started later inherit their creator's slice.

Failure behaviour: where the call is not there (not Linux, an architecture without a known syscall number, a
seccomp filter) it returns False and changes nothing; kernels before 6.12 accept the call and ignore the slice
for ``SCHED_OTHER`` (the slice read back tells: ``request_slice_ms``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys

SCHED_OTHER = 0
SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
"""(sched_setattr, sched_getattr) per machine."""
MIN_SLICE_MS, MAX_SLICE_MS = 0.1, 100.0
"""The kernel clamps a requested slice to this range."""


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


def _calls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if numbers is None:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True), numbers[0], numbers[1]
    except OSError:
        return None


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _get(libc: ctypes.CDLL, nr_get: int, tid: int) -> _SchedAttr | None:
    attr = _SchedAttr()
    size = ctypes.sizeof(_SchedAttr)
    if libc.syscall(nr_get, tid, ctypes.byref(attr), size, 0) != 0:
        return None
    return attr


def set_request_slice(slice_ms: float) -> bool:
    """Ask for a ``slice_ms`` slice for every thread of this process (see the module docstring).

    True when every ``SCHED_OTHER`` thread took the request (a thread under another policy is left as it is).
    """
    if not MIN_SLICE_MS <= slice_ms <= MAX_SLICE_MS:
        raise ValueError(f"slice_ms must lie in [{MIN_SLICE_MS}, {MAX_SLICE_MS}] (got {slice_ms})")
    calls = _calls()
    if calls is None:
        return False
    libc, nr_set, nr_get = calls
    ok = True
    for tid in _threads():
        attr = _get(libc, nr_get, tid)
        if attr is None:
            ok = False
            continue
        if attr.sched_policy != SCHED_OTHER:
            continue
        attr.size = ctypes.sizeof(_SchedAttr)
        attr.sched_runtime = round(slice_ms * 1e6)
        attr.sched_flags = 0  # leave the utilization clamps alone
        with contextlib.suppress(OSError):
            if libc.syscall(nr_set, tid, ctypes.byref(attr), 0) == 0:
                continue
        ok = False
    return ok


def request_slice_ms(tid: int = 0) -> float | None:
    """The slice the scheduler has for thread ``tid`` (0: the caller), None where it cannot be read."""
    calls = _calls()
    if calls is None:
        return None
    attr = _get(calls[0], calls[2], tid)
    return None if attr is None else attr.sched_runtime / 1e6
