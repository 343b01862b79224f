"""Lookahead for a new prefix home: is the wait behind a busy worker worth the balance it keeps?

``kv_aware`` sends a miss among near ties to a worker that has computed no more than its share (the balance
rule, ``kv_aware`` module docstring), since the worker a new prefix lands on becomes its home and draws its
later requests. When every balanced worker is busy and a less balanced one is idle, that rule makes the miss
wait behind the busy one's current step (the wait term, ``KVAware.wait_blocks``) for a gain that only comes
later. This module prices both sides in the same unit and lets the smaller one give way:

    wait saved     = wait(B) - wait(A)                 (B: the balanced worker, A: the less busy one)
    balance gain   = later x (busy(A) - busy(B)) x wait(B)
    A goes first  iff  wait saved > balance gain

- ``later``, the requests the new prefix will still bring to its home, is its arrival rate times how long
  its home keeps it: ``rate = hits / home-seconds`` (requests routed to a worker that held their prefix,
  over the time the homes made so far have existed, each counted at most ``keep``), and ``keep``: unbounded
  while the pool has computed no more blocks than its caches hold (nothing can have been evicted: every
  home made so far still serves its prefix, so balance pays off for as long as the prefix is used, and
  wins), then ``cache blocks of the pool / blocks computed per second`` (the time the pool takes to write
  over its caches once: LRU keeps a prefix about that long after its last use). Estimates from the run so
  far, never a tuned constant: under heavy churn a home is short lived and the wait counts for more.
- ``busy(w)``, the chance that a later request finds ``w`` busy and waits behind its step, is the share of
  routing decisions at which ``w`` had requests open: arrivals sample the worker's state as it is over
  time (Poisson arrivals see time averages), so no busy clock is needed.
- ``wait(B)`` prices each later request that meets a busy home: about the wait this one would meet now.

A later request on the less busy home waits ``busy(B) x wait`` on average instead of ``busy(A) x wait``,
so the gain is what the prefix's later requests save in all; the miss saves its wait once.

Off by default (``KVAware.Params.lookahead``). On ``bench/router.py --parts prefix-virtual`` (4 seeds, kv_aware):
- at 1x and 2x it changes no decision: every home is made before the pool has filled its caches, so balance
  wins. That is right there: at 1x seed 0, sending the two misses that met a busy balanced worker to the idle
  one anyway (homes 3/2/2/1, 38 against 108 requests) saved 7 and 12 ms on them and cost TTFT mean 3%
  (14.38 -> 14.83 ms: 0.45 ms x 300 requests, against 20 ms saved); TTFT p99 stays 47.3 ms, the floor of a miss.
  An earlier form that estimated ``later`` from the homes' hits so far, and ``keep`` from the rate of
  blocks computed, made exactly that choice: early in a run both are biased low (the homes are young, the
  rate is the burst of first misses).
- at 4x it changes seeds 0 and 2 only, in opposite directions: seed 0 hit ratio 0.743 -> 0.725, TTFT mean
  21.3 -> 22.3 ms, p99 58.4 -> 57.5; seed 2 hit ratio 0.729 -> 0.740, mean 22.4 -> 21.9, p99 58.8 -> 52.9.
  What the model leaves out: at 4x a home also presses on its worker's cache (more homes there evict each
  other sooner), so the busy shares, nearly equal there (0.42-0.52), understate what balance keeps.
"""

from __future__ import annotations

from collections import deque

from cluster.router.view import WorkerId, WorkerInfo

MAX_HOMES = 4096
"""Home start times kept (the oldest count as ``keep`` long when dropped: beyond it they are gone anyway)."""


class HomeLookahead:
    """What the trade needs from the routing seen so far: busy shares, home starts, hits (module docstring)."""

    def __init__(self) -> None:
        self.first_s: float | None = None
        self.decisions = 0
        self.busy: dict[WorkerId, int] = {}
        """Decisions at which each worker had requests open."""
        self.homes: deque[float] = deque(maxlen=MAX_HOMES)
        """When each miss (a new prefix home) was routed, oldest first."""
        self.dropped_homes = 0
        self.hits = 0
        self.computed = 0
        """Prompt blocks routed to be computed, all workers."""

    def observe(self, candidates: list[WorkerInfo], now_s: float) -> None:
        """One routing decision: the candidates' busy state as the request found it."""
        if self.first_s is None:
            self.first_s = now_s
        self.decisions += 1
        for w in candidates:
            if w.load > 0:
                self.busy[w.name] = self.busy.get(w.name, 0) + 1

    def routed(self, held: int, computed: int, now_s: float) -> None:
        """A request went to a worker holding ``held`` of its blocks, to compute ``computed`` more."""
        self.computed += max(0, computed)
        if held > 0:
            self.hits += 1
            return
        if len(self.homes) == self.homes.maxlen:
            self.dropped_homes += 1
        self.homes.append(now_s)

    def busy_share(self, name: WorkerId) -> float:
        return self.busy.get(name, 0) / self.decisions if self.decisions else 0.0

    def keep_s(self, capacity_blocks: int, now_s: float) -> float:
        """How long a home keeps its prefix: inf until the pool has computed more blocks than its caches hold
        (no block can have been evicted yet, so every home made so far still holds its prefix), then the time
        the pool takes to compute a cache-full of blocks at its rate so far (LRU keeps a prefix about that
        long after its last use)."""
        elapsed = now_s - (self.first_s if self.first_s is not None else now_s)
        if self.computed <= capacity_blocks or elapsed <= 0:
            return float("inf")
        return capacity_blocks * elapsed / self.computed

    def later_requests(self, capacity_blocks: int, now_s: float) -> float:
        """The requests a new prefix is expected to bring its home after this one (``later``)."""
        keep = self.keep_s(capacity_blocks, now_s)
        if keep == float("inf"):
            return keep
        home_s = sum(min(max(0.0, now_s - t), keep) for t in self.homes) + self.dropped_homes * keep
        if self.hits == 0 or home_s <= 0:
            return 0.0
        return self.hits / home_s * keep

    def idle_first(self, balanced: WorkerInfo, other: WorkerInfo, wait_balanced: float, wait_other: float,
                   capacity_blocks: int, now_s: float) -> bool:
        """True when a new home on ``other`` (less busy now, less balanced) costs less than the wait on
        ``balanced``: wait saved > later x (busy(other) - busy(balanced)) x wait(balanced)."""
        saved = wait_balanced - wait_other
        if saved <= 0:
            return False
        later = self.later_requests(capacity_blocks, now_s)
        if later == float("inf"):
            return False  # no home has lost its prefix yet: balance keeps paying for as long as it is used
        skew = max(0.0, self.busy_share(other.name) - self.busy_share(balanced.name))
        return saved > later * skew * wait_balanced
