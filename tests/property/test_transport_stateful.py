"""Stateful properties of the transport's pure parts: the buffer pool and processor sharing."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from transport.link import ProcessorSharing
from transport.pool import BufferPool, Lease, size_class


class PoolMachine(RuleBasedStateMachine):
    """Leases never exceed the budget, are counted exactly, and hand out disjoint buffers."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BufferPool(1 << 20)
        self.held: list[Lease] = []

    @rule(target=leases, n=st.integers(0, 1 << 19))
    def acquire(self, n: int) -> Lease | None:
        lease = self.pool.acquire(n)
        if lease is None:
            assert self.pool.in_use_bytes + size_class(n) > self.pool.capacity
            return None
        assert lease.view.nbytes == n
        assert all(lease.buffer is not h.buffer for h in self.held)
        self.held.append(lease)
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease: Lease | None) -> None:
        if lease is not None:
            lease.release()
            self.held.remove(lease)

    @invariant()
    def budget(self) -> None:
        p = self.pool
        assert p.in_use_bytes <= p.allocated_bytes <= p.capacity
        assert p.leases == len(self.held)
        assert p.in_use_bytes == sum(size_class(h.nbytes) for h in self.held)


class SharingMachine(RuleBasedStateMachine):
    """Processor sharing is work-conserving: while any flow is active the link drains at full rate."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = ProcessorSharing(rate_bytes_per_ms=1000.0)
        self.next_id = 0
        self.added = 0.0
        self.removed_left = 0.0
        self.finished: dict[int, float] = {}
        self.busy_ms = 0.0

    def _advance(self, dt: float) -> None:
        t0, active = self.ps.t, self.ps.active
        done = self.ps.advance(t0 + dt)
        for f, t in done:
            assert t0 - 1e-9 <= t <= t0 + dt + 1e-9
            self.finished[f] = t
        # busy time: the link worked from t0 until the last flow finished (or the whole dt)
        end = t0 + dt if self.ps.active else max([t for _, t in done], default=t0)
        self.busy_ms += (end - t0) if (active or done) else 0.0

    @rule(nbytes=st.floats(0, 5000), dt=st.floats(0, 10))
    def add(self, nbytes: float, dt: float) -> None:
        self._advance(dt)
        for f, t in self.ps.add(self.ps.t, self.next_id, nbytes):
            self.finished[f] = t
        self.added += nbytes
        self.next_id += 1

    @rule(dt=st.floats(0, 10))
    def wait(self, dt: float) -> None:
        self._advance(dt)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        if self.ps.remaining:
            f = data.draw(st.sampled_from(sorted(self.ps.remaining)))
            self.removed_left += self.ps.remaining[f]
            self.ps.remove(self.ps.t, f)

    @invariant()
    def work_conserving(self) -> None:
        drained = self.added - self.removed_left - sum(self.ps.remaining.values())
        # a flow left with at most EPS bytes counts as drained without link time (the link's documented
        # floating-point slack), so each flow may add up to EPS beyond the relative tolerance
        slack = 1e-6 * max(1.0, self.added) + self.ps.EPS * self.next_id
        assert abs(drained - self.busy_ms * self.ps.rate) <= slack
        assert all(r > 0 for r in self.ps.remaining.values())

    @invariant()
    def predictions_agree(self) -> None:
        if self.ps.remaining:
            preds = [self.ps.predict(f) for f in self.ps.remaining]
            assert all(p is not None and p >= self.ps.t for p in preds)
            assert min(p for p in preds if p is not None) == pytest.approx(self.ps.next_completion())


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSharing = SharingMachine.TestCase
TestSharing.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
