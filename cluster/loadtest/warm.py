"""Keep-alive connections opened before the run's origin, so a burst of sends finds them idle.

Why. aiohttp's connector (``TCPConnector(limit=0)``: no cap) hands a request an idle keep-alive connection of
the same host when it holds one, and otherwise opens a new TCP connection: a connect the target must accept,
and a loop round trip on both sides before the request's bytes can go. A trace that fires 8-16 requests at one
timestamp (the Mooncake conversation trace) found the pool empty at its first bursts and at every new peak
of open streams, so those sends connected first. In a probe against a stand-in aiohttp server (16-request
bursts, 2-core host under other work, direction only) the last send of a burst started 22 ms after the
first with a cold pool and 6 ms with a warm one (sends one loop pass apart, as the replayer issued them then).
A connect also adds to the request's TTFT, which is measured from the send.

Algorithm.

- ``warm_count(deadlines_s, window_s, cap)``: the largest number of requests whose wall deadlines fall within
  any ``window_s`` seconds (two pointers over the sorted deadlines), capped at ``cap``. That is how many
  connections the trace holds at once if no request outlives ``window_s``: a bound from the schedule alone,
  since how long requests last depends on the target. Past it, aiohttp opens more as before.
- ``open_warm(session, base_url, n)``: ``n`` concurrent GETs of the target's model list (``/v1/models``,
  served by every OpenAI-compatible server and cheap) started in one loop pass, so none finds a connection
  released by another and the connector opens ``n``; each answer is read to its end, which returns its
  connection to the pool. A failure (refused, reset, timeout) only leaves that connection unopened: it is
  counted, never raised, so warming can not fail a run. Any HTTP status keeps the connection (a 404 from a
  target without the route still answers on a live keep-alive connection).

The connector keeps an idle connection for its ``keepalive_timeout`` (aiohttp's default, 15 s) and hands out
the longest-idle first, so a pool a trace keeps cycling within that time stays open for the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

WARM_WINDOW_S = 5.0
"""Wall seconds a request is assumed to hold its connection when sizing the pool (Mooncake-slice requests on
kvmesh at time scale 1 last ~3 s: TTFT ~0.3 s plus ~370 output tokens at ~7.6 ms)."""
WARM_CAP = 256
"""Connections opened ahead at most, whatever the trace (each holds a socket on both sides)."""
WARM_PATH = "/v1/models"
WARM_TIMEOUT_S = 10.0


def warm_count(deadlines_s: Sequence[float], window_s: float = WARM_WINDOW_S, cap: int = WARM_CAP) -> int:
    """The largest number of ``deadlines_s`` (wall seconds, any order) within any ``window_s`` seconds
    (both ends included), at most ``cap``; 0 for no deadlines."""
    if window_s < 0:
        raise ValueError(f"window_s must be >= 0 (got {window_s})")
    if cap < 0:
        raise ValueError(f"cap must be >= 0 (got {cap})")
    ordered = sorted(deadlines_s)
    best = 0
    lo = 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] > window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return min(best, cap)


async def open_warm(session: aiohttp.ClientSession, base_url: str, n: int,
                    timeout_s: float = WARM_TIMEOUT_S) -> int:
    """Open ``n`` keep-alive connections to ``base_url`` on ``session``'s connector (see the module docstring);
    returns how many answered (each left its connection in the pool)."""
    if n <= 0:
        return 0
    url = f"{base_url.rstrip('/')}{WARM_PATH}"
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one() -> bool:
        try:
            async with session.get(url, timeout=timeout) as resp:
                await resp.read()
                return True
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    answers = await asyncio.gather(*(one() for _ in range(n)))
    return sum(answers)
