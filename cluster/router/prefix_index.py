"""The router's global prefix index: which worker's prefix cache holds which block hashes.

``PrefixIndex`` is fed by the engines' KV events. Each worker's batches are numbered 1, 2, 3 ...;
the index applies them in order: a duplicate (already applied) is ignored, a batch from the future is
held back until the ones before it arrive (reordering), and when more than ``max_pending`` batches wait
on a missing one (loss), the worker is marked for resync: its entries are kept but its state is
rebuilt from the next snapshot. ``drop_worker`` forgets a worker that left.

``ApproximateIndex`` serves engines that publish no events: it remembers which blocks the router sent
where, for ``ttl_ms``.

Both answer ``overlap(hashes, workers)``: per worker, how many *leading* blocks of the request it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cluster.router.view import WorkerId


class PrefixIndex:
    def __init__(self, max_pending: int = 64) -> None:
        self.max_pending = max_pending
        self._holders: dict[int, set[WorkerId]] = {}
        self._blocks: dict[WorkerId, set[int]] = {}
        self._seq: dict[WorkerId, int] = {}
        self._pending: dict[WorkerId, dict[int, list[list[Any]]]] = {}
        self.needs_resync: set[WorkerId] = set()
        self.applied = 0
        self.duplicates = 0
        self.resyncs = 0

    # -- feeding -----------------------------------------------------------------------------------
    def apply_snapshot(self, worker: WorkerId, seq: int, hashes: Iterable[int]) -> None:
        """Replace everything known about ``worker`` by its full state as of batch ``seq``."""
        self._forget(worker)
        blocks = set(hashes)
        self._blocks[worker] = blocks
        for h in blocks:
            self._holders.setdefault(h, set()).add(worker)
        self._seq[worker] = seq
        self._pending[worker] = {}
        self.needs_resync.discard(worker)

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
            if kind == "stored":
                for h in ev[1]:
                    blocks.add(h)
                    self._holders.setdefault(h, set()).add(worker)
            elif kind == "removed":
                for h in ev[1]:
                    blocks.discard(h)
                    holders = self._holders.get(h)
                    if holders is not None:
                        holders.discard(worker)
                        if not holders:
                            del self._holders[h]
            elif kind == "cleared":
                self._forget(worker)
                self._blocks[worker] = set()

    def _forget(self, worker: WorkerId) -> None:
        for h in self._blocks.pop(worker, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def drop_worker(self, worker: WorkerId) -> None:
        self._forget(worker)
        self._seq.pop(worker, None)
        self._pending.pop(worker, None)
        self.needs_resync.discard(worker)

    # -- queries -----------------------------------------------------------------------------------
    def last_seq(self, worker: WorkerId) -> int | None:
        return self._seq.get(worker)

    def blocks_of(self, worker: WorkerId) -> int:
        return len(self._blocks.get(worker, ()))

    def overlap(self, hashes: Sequence[int], workers: Iterable[WorkerId]) -> dict[WorkerId, int]:
        """Leading blocks of ``hashes`` each worker holds (0 for a worker that holds none)."""
        out = dict.fromkeys(workers, 0)
        alive = set(out)
        for depth, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for w in alive:
                out[w] = depth + 1
        return out

    def size(self) -> int:
        return len(self._holders)


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
