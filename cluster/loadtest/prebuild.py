"""Request bodies built ahead of their send time, so the open loop's send path only sends.

Why. A trace like Mooncake's conversation trace fires its requests in bursts (about 9 sharing one 3 s
timestamp) with prompts up to ~120k tokens. Built at the send time, each body (prompt synthesis and JSON
encoding, up to ~13 ms for the largest) delayed every later request of its burst, and the generator's send
lag p99 reached 30-37 ms (the trust threshold is 10 ms).

Algorithm. ``Prebuilder`` walks the specs in send order and keeps the bodies of the next requests ready, in
order, within a byte budget:

- ``fill(before)`` builds the next bodies one by one while there is time left before ``before`` (the next
  send's wall deadline; None: no deadline) and the bodies held stay within ``budget_bytes`` (the first
  body held is always allowed, so a single body larger than the budget still goes ahead of its time). It
  yields to the loop after each body so open streams are read between them (their chunks are timestamped
  at read time).
- ``take()`` hands out the next request's body: the one built ahead, or, when the fill never reached it
  (no time between deadlines, or the budget was spent), one built now. The order is the specs' order
  whatever happened; every spec is handed out exactly once.

The replayer fills before taking the origin (the run's first bodies cost nothing on the schedule) and,
during the run, between deadlines while the time left exceeds ``REFILL_MARGIN_S`` and twice the longest
build seen so far (a build never makes the next send late by itself). The bodies are byte-identical to
those built at send time; what the records measure (send lag = send start - deadline) is unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from cluster.loadtest.client import PreparedRequest
from cluster.loadtest.spec import RequestSpec

REFILL_MARGIN_S = 0.02
"""Wall seconds that must be left before the next deadline for a build to start during the run."""
DEFAULT_BUDGET_BYTES = 256 * 2**20
"""Bodies held ahead at most (the first 600 s of the Mooncake conversation trace are ~140 MB in all)."""


class Prebuilder:
    """Bodies of the next requests, built ahead in send order within a byte budget; see the module docstring.

    Invariants: ``take`` returns the specs' requests in order, each once; the bodies held never exceed
    ``budget_bytes`` unless one body alone does. Failure behaviour: an exception from ``prepare`` (a bad
    spec) propagates from ``fill`` or ``take`` unchanged, as it did when bodies were built at send time.
    """

    def __init__(self, prepare: Callable[[RequestSpec], PreparedRequest], specs: Sequence[RequestSpec],
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, monotonic: Callable[[], float] = time.monotonic) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 (got {budget_bytes})")
        self._prepare = prepare
        self._specs = specs
        self.budget_bytes = budget_bytes
        self._monotonic = monotonic
        self._ready: deque[PreparedRequest] = deque()
        self._held_bytes = 0
        self._next_build = 0
        """Index of the next spec to build."""
        self._next_take = 0
        self.built_ahead = 0
        """Bodies handed out that were built ahead by ``fill``."""
        self.built_late = 0
        """Bodies handed out that ``take`` had to build itself."""
        self.longest_build_s = 0.0

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    @property
    def ready(self) -> int:
        """Bodies built and not taken yet."""
        return len(self._ready)

    def _build(self) -> PreparedRequest:
        t0 = self._monotonic()
        prepared = self._prepare(self._specs[self._next_build])
        self.longest_build_s = max(self.longest_build_s, self._monotonic() - t0)
        self._next_build += 1
        return prepared

    def _room(self) -> bool:
        return self._next_build < len(self._specs) and (not self._ready or self._held_bytes < self.budget_bytes)

    async def fill(self, before: float | None = None) -> int:
        """Build bodies ahead while there is time before the wall deadline ``before`` (``time_left``; None:
        no deadline) and the budget allows; returns how many were built."""
        n = 0
        while self._room() and (before is None or self.time_left(before)):
            prepared = self._build()
            self._ready.append(prepared)
            self._held_bytes += len(prepared.body)
            n += 1
            await asyncio.sleep(0)
        return n

    def take(self) -> PreparedRequest:
        """The next request's prepared body (built now if the fill did not reach it)."""
        if self._next_take >= len(self._specs):
            raise IndexError("every request was already taken")
        self._next_take += 1
        if self._ready:
            prepared = self._ready.popleft()
            self._held_bytes -= len(prepared.body)
            self.built_ahead += 1
            return prepared
        self.built_late += 1
        return self._build()

    def time_left(self, deadline_wall: float) -> bool:
        """Whether a build may start now with ``deadline_wall`` (monotonic seconds) the next send."""
        margin = max(REFILL_MARGIN_S, 2.0 * self.longest_build_s)
        return deadline_wall - self._monotonic() > margin
