"""The router's global prefix index: which worker's prefix cache holds which block hashes.

``PrefixIndex`` is fed by the engines' KV events. Each worker's batches are numbered 1, 2, 3 ...;
the index applies them in order: a duplicate (already applied) is ignored, a batch from the future is
held back until the ones before it arrive (reordering), and when more than ``max_pending`` batches wait
on a missing one (loss), the worker is marked for resync: its entries are kept but its state is
rebuilt from the next snapshot. ``drop_worker`` forgets a worker that left.

``InflightPrefixes`` holds what the router sent where and has not yet seen confirmed by KV events (as
Dynamo's KV router tracks the blocks of active requests): a request's blocks count as a *provisional*
overlap on its worker from the moment it is routed, so requests for the same prefix that arrive while the
first is still queued or prefilling find it, where the events arrive only after the prefill. Reconciled by
the events (a ``stored`` block or a snapshot replaces the provisional entry by the real one), dropped when
the attempt fails, when the worker leaves, or ``ttl_ms`` after routing (a request whose events were lost).

``ApproximateIndex`` serves engines that publish no events: it remembers which blocks the router sent
where, for ``ttl_ms``.

Events may name the medium (vLLM's ``medium``: ``["stored", hashes, parent, medium]``, ``["removed", hashes,
medium]``; absent means ``GPU``): GPU blocks are the index proper, blocks in lower media go to ``tiers``
(``cluster.router.tiers.TierHoldings``), which ``kv_aware`` prices by their load time. A snapshot replaces the
GPU state only (it lists the prefix cache).

All answer ``overlap(hashes, workers)``: per worker, how many *leading* blocks of the request it holds;
``PrefixIndex.overlap(..., inflight=...)`` counts a block held either way.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, NewType

from actors.engine.tiers.base import MEDIUM_GPU
from cluster.router.tiers import TierHoldings, medium_of
from cluster.router.view import WorkerId

Ticket = NewType("Ticket", int)
"""One routed attempt's provisional entries."""


class InflightPrefixes:
    """Provisional (worker, block) entries of routed attempts, until KV events confirm them.

    Invariants: ``_entries[w][h]`` names the live tickets that sent block ``h`` to ``w`` (never none); a ticket
    is live until it is dropped (failure), expires (``ttl_ms`` after it was recorded, on the clock the caller
    passes) or its worker leaves. ``confirm`` removes entries (the real index holds them now) but leaves the
    tickets, which forget them when they go. Nothing here is ever a hard fact: a block the engine evicted
    before storing it would be a wrong provisional hit for at most ``ttl_ms``.

    Layout, for the cyclic garbage collector: one dict per worker, by block hash, whose value is the one
    ticket (an int) or, for a block that more than one live ticket sent there, a set of them. A new prefix's
    miss records ~140 blocks; as ``(worker, h)`` keys and a set per block, those were ~140 objects the collector
    tracks per miss (in ``bench/router_miss``'s router, nearly every object it tracked: a young collection
    every ~2.5 misses and an older one every ~25, each on the router's loop); ints in a dict add none.
    """

    def __init__(self, ttl_ms: float = 30_000.0) -> None:
        self.ttl_ms = ttl_ms
        self._entries: dict[WorkerId, dict[int, int | set[int]]] = {}
        self._tickets: dict[Ticket, tuple[WorkerId, tuple[int, ...]]] = {}
        self._expiry: list[tuple[float, Ticket]] = []
        self._ids = itertools.count(1)
        self.confirmed = 0
        self.expired = 0

    def record(self, worker: WorkerId, hashes: Sequence[int], now_ms: float) -> Ticket:
        self.expire(now_ms)
        t = Ticket(next(self._ids))
        self._tickets[t] = (worker, tuple(hashes))
        heapq.heappush(self._expiry, (now_ms + self.ttl_ms, t))
        entries = self._entries.get(worker)
        if entries is None:
            entries = self._entries[worker] = {}
        if entries.keys().isdisjoint(hashes):  # (the common case, a new prefix's blocks: one C call)
            entries.update(dict.fromkeys(hashes, t))
            return t
        for h in hashes:
            live = entries.get(h)
            if live is None:
                entries[h] = t
            elif isinstance(live, int):
                if live != t:
                    entries[h] = {live, t}
            else:
                live.add(t)
        return t

    def drop(self, ticket: int | None) -> None:
        """The attempt failed (or is otherwise void): its entries go."""
        if ticket is None:
            return
        item = self._tickets.pop(Ticket(ticket), None)
        if item is None:
            return
        worker, hashes = item
        entries = self._entries.get(worker)
        if entries is None:
            return
        for h in hashes:
            live = entries.get(h)
            if live is None:
                continue
            if isinstance(live, int):
                if live == ticket:
                    del entries[h]
                continue
            live.discard(ticket)
            if len(live) == 1:
                entries[h] = next(iter(live))
            elif not live:
                del entries[h]

    def expire(self, now_ms: float) -> None:
        while self._expiry and self._expiry[0][0] <= now_ms:
            _, t = heapq.heappop(self._expiry)
            if t in self._tickets:
                self.expired += 1
                self.drop(t)

    def confirm(self, worker: WorkerId, hashes: Iterable[int]) -> None:
        """KV events say ``worker`` stored these blocks: the real index answers for them from now on."""
        entries = self._entries.get(worker)
        if not entries:
            return
        held = entries.keys() & hashes  # (in C: a stored frame holds ~136 blocks, on the loop the requests share)
        if held:
            deque(map(entries.pop, held), maxlen=0)
            self.confirmed += len(held)

    def drop_worker(self, worker: WorkerId) -> None:
        for t in [t for t, (w, _) in self._tickets.items() if w == worker]:
            self.drop(t)
        self._entries.pop(worker, None)

    def holds(self, worker: WorkerId, h: int) -> bool:
        entries = self._entries.get(worker)
        return entries is not None and h in entries

    def of(self, worker: WorkerId) -> Mapping[int, object]:
        """The blocks provisionally on ``worker`` (by hash; read-only)."""
        return self._entries.get(worker) or _NONE

    def overlap(self, hashes: Sequence[int], workers: Iterable[WorkerId], now_ms: float) -> dict[WorkerId, int]:
        self.expire(now_ms)
        out: dict[WorkerId, int] = {}
        for w in workers:
            entries = self.of(w)
            n = 0
            for h in hashes:
                if h not in entries:
                    break
                n += 1
            out[w] = n
        return out

    def __len__(self) -> int:
        return sum(map(len, self._entries.values()))


_NONE: Mapping[int, object] = {}


class PrefixIndex:
    def __init__(self, max_pending: int = 64, inflight: InflightPrefixes | None = None) -> None:
        self.max_pending = max_pending
        self.inflight = inflight
        """Provisional entries this index reconciles as events arrive (``None``: none kept)."""
        self._blocks: dict[WorkerId, set[int]] = {}
        """By worker: the block hashes it holds. The only map: a ``stored`` or ``removed`` batch is one C call on a
        worker's set, and a worker's leading overlap is a C walk of its set (``_leading``), no Python per block
        (a map of holders by block was a Python step per block on every event and every lookup: ~120 us to apply
        one 136-block ``stored`` frame, ~30 us to walk a 136-block hit). One set per worker: nothing per block
        for the cyclic collector."""
        self._seq: dict[WorkerId, int] = {}
        self._pending: dict[WorkerId, dict[int, list[list[Any]]]] = {}
        self.needs_resync: set[WorkerId] = set()
        self.tiers = TierHoldings()
        """Blocks in lower media (CPU, disk, store), from events that name one (``cluster.router.tiers``)."""
        self.applied = 0
        self.duplicates = 0
        self.resyncs = 0

    # -- feeding -----------------------------------------------------------------------------------
    def apply_snapshot(self, worker: WorkerId, seq: int, hashes: Iterable[int]) -> None:
        """Replace everything known about ``worker`` by its full state as of batch ``seq``."""
        blocks = set(hashes)
        self._blocks[worker] = blocks
        self._seq[worker] = seq
        self._pending[worker] = {}
        self.needs_resync.discard(worker)
        if self.inflight is not None:
            self.inflight.confirm(worker, blocks)

    def apply(self, worker: WorkerId, seq: int, events: Sequence[list[Any]]) -> bool:
        """Apply batch ``seq``; returns False when the worker needs a resync (a batch was lost)."""
        last = self._seq.get(worker)
        if last is None or worker in self.needs_resync:
            self.needs_resync.add(worker)
            return False
        if seq <= last:
            self.duplicates += 1
            return True
        pending = self._pending.setdefault(worker, {})
        pending[seq] = list(events)
        while last + 1 in pending:
            last += 1
            self._apply_events(worker, pending.pop(last))
            self.applied += 1
        self._seq[worker] = last
        if len(pending) > self.max_pending:
            self.needs_resync.add(worker)
            self.resyncs += 1
            return False
        return True

    def _apply_events(self, worker: WorkerId, events: Sequence[list[Any]]) -> None:
        blocks = self._blocks.setdefault(worker, set())
        for ev in events:
            kind = ev[0]
            if kind == "stored" and (medium := medium_of(ev, 3)) != MEDIUM_GPU:
                self.tiers.stored(worker, medium, ev[1])
            elif kind == "removed" and (medium := medium_of(ev, 2)) != MEDIUM_GPU:
                self.tiers.removed(worker, medium, ev[1])
            elif kind == "stored":
                blocks.update(ev[1])
                if self.inflight is not None:
                    self.inflight.confirm(worker, ev[1])
            elif kind == "removed":
                blocks.difference_update(ev[1])
            elif kind == "cleared":
                blocks = self._blocks[worker] = set()

    def drop_worker(self, worker: WorkerId) -> None:
        self._blocks.pop(worker, None)
        self.tiers.forget(worker)
        self._seq.pop(worker, None)
        self._pending.pop(worker, None)
        self.needs_resync.discard(worker)
        if self.inflight is not None:
            self.inflight.drop_worker(worker)

    # -- queries -----------------------------------------------------------------------------------
    def last_seq(self, worker: WorkerId) -> int | None:
        return self._seq.get(worker)

    def blocks_of(self, worker: WorkerId) -> int:
        return len(self._blocks.get(worker, ()))

    def hashes_of(self, worker: WorkerId) -> frozenset[int]:
        """The block hashes the index believes ``worker`` holds (to compare with the engine's own state)."""
        return frozenset(self._blocks.get(worker, ()))

    def overlap(self, hashes: Sequence[int], workers: Iterable[WorkerId],
                now_ms: float | None = None) -> dict[WorkerId, int]:
        """Leading blocks of ``hashes`` each worker holds (0 for a worker that holds none); with ``now_ms``
        and an in-flight tracker, a block counts when the events show it *or* it is provisionally there."""
        if self.inflight is not None and now_ms is not None and len(self.inflight):
            return self._overlap_with_inflight(hashes, list(workers), self.inflight, now_ms)
        blocks = self._blocks
        return {w: _leading(blocks.get(w) or _EMPTY, hashes) for w in workers}

    def _overlap_with_inflight(self, hashes: Sequence[int], workers: list[WorkerId], inflight: InflightPrefixes,
                               now_ms: float) -> dict[WorkerId, int]:
        """The events' overlap, each worker's then extended block by block by either source (a hit's blocks are
        mostly the events': their depth comes from the C walk, not from a Python check per block)."""
        inflight.expire(now_ms)
        out = self.overlap(hashes, workers)
        n = len(hashes)
        for w in workers:
            entries = inflight.of(w)
            if not entries:
                continue  # (the events alone: ``out`` already holds their depth)
            held = self._blocks.get(w) or _EMPTY
            d = out[w]
            while d < n:
                h = hashes[d]
                if h not in held and h not in entries:
                    break
                d += 1
            out[w] = d
        return out

    def held_depth(self, worker: WorkerId, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the events show ``worker`` holding (no in-flight entries)."""
        return _leading(self._blocks.get(worker) or _EMPTY, hashes)

    def size(self) -> int:
        """Distinct blocks held anywhere (a union: for tests and reports, not the request path)."""
        return len(set().union(*self._blocks.values()))


_EMPTY: frozenset[int] = frozenset()


def _leading(held: Container[int], hashes: Iterable[int]) -> int:
    """How many leading ``hashes`` ``held`` contains: ``takewhile`` over the set's own ``__contains__``, all in C
    (a 136-block hit: one set lookup per block and no Python frame per block)."""
    return len(list(itertools.takewhile(held.__contains__, hashes)))


class ApproximateIndex:
    """What the router itself sent where, forgotten after ``ttl_ms`` (for engines without KV events)."""

    def __init__(self, ttl_ms: float = 120_000.0) -> None:
        self.ttl_ms = ttl_ms
        self._seen: dict[tuple[WorkerId, int], float] = {}

    def record(self, worker: WorkerId, hashes: Sequence[int], now_ms: float) -> None:
        for h in hashes:
            self._seen[(worker, h)] = now_ms

    def expire(self, now_ms: float) -> None:
        cutoff = now_ms - self.ttl_ms
        stale = [k for k, t in self._seen.items() if t < cutoff]
        for k in stale:
            del self._seen[k]

    def drop_worker(self, worker: WorkerId) -> None:
        for k in [k for k in self._seen if k[0] == worker]:
            del self._seen[k]

    def overlap(self, hashes: Sequence[int], workers: Iterable[WorkerId], now_ms: float) -> dict[WorkerId, int]:
        cutoff = now_ms - self.ttl_ms
        out: dict[WorkerId, int] = {}
        for w in workers:
            n = 0
            for h in hashes:
                t = self._seen.get((w, h))
                if t is None or t < cutoff:
                    break
                n += 1
            out[w] = n
        return out
