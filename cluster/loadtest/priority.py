"""The load generator's CPU priority: the replay's thread at the emulated engines' niceness for the run.

Why: an emulated GPU's process runs below niceness 0 where the host allows it (``ClusterSpec.engine_nice``,
-5 by default) so its steps end on time on a host it shares with the router and the load generator. A load
generator left at 0 on that host waits for a core behind the engines: in the 60 s Mooncake slice on 8 GPUs
(``bench/density.py``, 2 cores) it ran 8.1 s and waited 4.3 s runnable, and its send lag p99 (14.6 wall ms)
passed the trust threshold although the engines kept their clock. The generator is the measuring instrument:
it must send on schedule and time each chunk as it arrives, so it gets the same priority as the engines
(not above: then the engines would wait behind it).

How: Linux keeps a niceness per thread (``PRIO_PROCESS`` names a thread id). Only the thread running the
replay's event loop is set, on entry, and set back on exit; threads it starts meanwhile (a resolver's
executor) inherit it. Other threads of the process (a Ray driver's, a caller's) are left alone. Lowering a
niceness needs root or CAP_SYS_NICE (or an ``RLIMIT_NICE`` that allows it): where the host refuses, the
thread keeps its niceness and the claim says so (``NiceClaim.note``), as ``engine_nice`` falls back for the
engines. Raising it back on exit is always allowed; lowering it back (after a claim above the old value by an
unprivileged process) may not be, and the claim notes that too.

Measured (60 s Mooncake slice, 8 GPUs, time scale 1, locked runs on a contended 2-core host, direction only):
the generator waited for a core 5.5 of 6.6 s run at niceness 0, 3.8-5.6 of 7.5-7.8 s at -5 (three runs),
2.5 of 7.5 s at -10, none under ``SCHED_RR``. Its send lag p99 did not follow at -5 (20.5-27.4 ms against
23.5 at 0): the late sends are the later requests of a same-timestamp burst (the slice has bursts of 8-16
requests; the first of a burst is sent 0.2-0.3 ms late at p50, each later one ~1.3 ms after the one before
at -5, ~0.6 ms at ``SCHED_RR``), i.e. the generator's own work of sending the burst in order. At -10 the
send lag p99 was 13.1 ms, under ``SCHED_RR`` 9.9 ms, but there the engines' step lag p99 rose to 9.6 ms
(they then wait behind the generator): the default stays level with the engines. The per-send gap was the
replay yielding a whole loop pass after each send; a burst now starts in one pass (``replay.py``, Bursts).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from config import ClusterSpec

ENGINE_NICE_DEFAULT: int = ClusterSpec.model_fields["engine_nice"].default
"""The engines' default niceness: the load generator's by default."""


@dataclass
class NiceClaim:
    """What the replay's thread asked for and ran at; ``note`` says why they differ."""

    wanted: int | None
    """None: the thread's niceness is left as it was."""
    before: int
    nice: int
    note: str | None = None

    def to_json(self) -> dict[str, int | str | None]:
        return {"nice": self.nice, "wanted": self.wanted, "before": self.before, "note": self.note}


def _thread_nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@contextmanager
def generator_priority(nice: int | None,
                       setpriority: Callable[[int, int, int], None] = os.setpriority) -> Iterator[NiceClaim]:
    """The calling thread at niceness ``nice`` until exit (None: unchanged); see the module docstring.
    ``setpriority``: the system call (a test passes one that refuses as an unprivileged host does)."""
    if nice is not None and not -20 <= nice <= 19:
        raise ValueError(f"a niceness is between -20 and 19 (got {nice})")
    tid = threading.get_native_id()
    before = _thread_nice(tid)
    claim = NiceClaim(wanted=nice, before=before, nice=before)
    if nice is not None and nice != before:
        try:
            setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            claim.note = (f"the load generator stayed at niceness {before}: taking {nice} (the engines' priority) "
                          f"needs root or CAP_SYS_NICE; on a host it shares with the engines it may wait for a core "
                          f"behind them (send lag shows it)")
        claim.nice = _thread_nice(tid)
    try:
        yield claim
    finally:
        if claim.nice != before:
            try:
                setpriority(os.PRIO_PROCESS, tid, before)
            except PermissionError:
                claim.note = (f"the load generator's thread stays at niceness {claim.nice} (was {before}): "
                              f"lowering it back needs root or CAP_SYS_NICE")


__all__ = ["ENGINE_NICE_DEFAULT", "NiceClaim", "generator_priority"]
