"""In-flight prefixes: what the router sent where counts as a provisional overlap until KV events confirm it,
and goes when the attempt fails, the worker leaves or the TTL passes (time from a virtual clock)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.choice import Chooser, RoutedRequest
from cluster.router.policies import make_policy
from cluster.router.prefix_index import InflightPrefixes, PrefixIndex
from cluster.router.regions import Topology
from cluster.router.view import ClusterView, RequestContext, WorkerId, WorkerInfo
from config.cluster import RouterSpec
from tests.virtual_clock import VirtualClock

A, B = WorkerId("a"), WorkerId("b")


def stored(*h: int) -> list:
    return ["stored", list(h), None]


def test_a_routed_prefix_counts_before_its_events_and_is_reconciled_by_them() -> None:
    inflight = InflightPrefixes(ttl_ms=1000.0)
    idx = PrefixIndex(inflight=inflight)
    idx.apply_snapshot(A, 0, [])
    idx.apply_snapshot(B, 0, [])
    inflight.record(A, [1, 2, 3], now_ms=0.0)
    assert idx.overlap([1, 2, 3, 4], [A, B], now_ms=10.0) == {A: 3, B: 0}
    assert idx.overlap([1, 2, 3, 4], [A, B]) == {A: 0, B: 0}  # the events alone know nothing yet
    assert idx.apply(A, 1, [stored(1, 2)])  # the engine stored two of them: those are facts now
    assert len(inflight) == 1 and inflight.confirmed == 2
    assert idx.overlap([1, 2, 3], [A], now_ms=20.0) == {A: 3}
    assert idx.apply(A, 2, [["removed", [2]]])  # evicted after the confirmation: the index says so
    assert idx.overlap([1, 2, 3], [A], now_ms=30.0) == {A: 1}


def test_provisional_entries_expire_on_the_clock_and_go_with_a_failed_attempt_or_a_departed_worker() -> None:
    inflight = InflightPrefixes(ttl_ms=1000.0)
    t1 = inflight.record(A, [1, 2], now_ms=0.0)
    t2 = inflight.record(A, [1, 2, 3], now_ms=500.0)
    inflight.drop(t1)  # the first attempt failed; the second still holds 1, 2, 3
    assert inflight.overlap([1, 2, 3], [A], now_ms=600.0) == {A: 3}
    assert inflight.overlap([1, 2, 3], [A], now_ms=1500.0) == {A: 0} and inflight.expired == 1
    inflight.drop(t2)  # already expired: nothing happens
    inflight.record(B, [7], now_ms=2000.0)
    inflight.drop_worker(B)
    assert len(inflight) == 0


def test_a_confirmed_block_re_sent_later_is_provisional_again_until_its_own_ticket_goes() -> None:
    inflight = InflightPrefixes(ttl_ms=1000.0)
    old = inflight.record(A, [1], now_ms=0.0)
    inflight.confirm(A, [1])
    inflight.record(A, [1], now_ms=10.0)
    inflight.drop(old)  # the old ticket no longer owns the entry: it stays
    assert inflight.holds(A, 1)


def _chooser(clock: VirtualClock) -> tuple[Chooser, list[WorkerInfo]]:
    ws = [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", model="m", num_blocks=1000, free_blocks=1000,
                     feed_connected=True) for i in range(3)]
    view = ClusterView(ws, now=lambda: clock.now_ms() / 1000.0)
    ch = Chooser(RouterSpec(policy="kv_aware", index_mode="events"), view, Topology(),
                 lambda w, new, cached: new / 100.0, random.Random(0))
    for w in ws:
        ch.index.apply_snapshot(w.name, 0, [])
    return ch, ws


def _route(ch: Chooser, prompt: list[int]) -> tuple[WorkerInfo, RequestContext]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    req = RoutedRequest.of(body, chat=False)
    ctx = RequestContext(body)
    pool = ch.eligible("m", None)
    policy = make_policy("kv_aware")
    ch.prepare(policy, ctx, req, pool)
    best = ch.rank(policy, pool, ctx)[0]
    ch.routed(policy, best, ctx)
    best.inflight += 1
    best.prefilling_blocks += ctx.num_blocks - ctx.overlap.get(best.name, 0)
    return best, ctx


def test_kv_aware_sends_a_prefix_still_prefilling_where_it_is_prefilling() -> None:
    clock = VirtualClock()
    ch, _ = _chooser(clock)
    shared = list(range(1000, 1000 + 64 * 16))
    first, _ = _route(ch, [*shared, 1, 2, 3])
    clock.t += 5.0  # no KV event yet: the first is still prefilling
    second, ctx = _route(ch, [*shared, 4, 5, 6])
    assert second is first and ctx.overlap[first.name] == 64
    other, _ = _route(ch, list(range(9000, 9000 + 64 * 16)))  # an unrelated prompt goes elsewhere
    assert other is not first


def test_without_in_flight_prefixes_the_same_burst_scatters() -> None:
    clock = VirtualClock()
    ws = [WorkerInfo(WorkerId(f"w{i}"), f"http://w{i}", model="m", num_blocks=1000, free_blocks=1000,
                     feed_connected=True) for i in range(3)]
    view = ClusterView(ws, now=lambda: clock.now_ms() / 1000.0)
    ch = Chooser(RouterSpec(policy="kv_aware", index_mode="events", inflight_prefixes=False), view, Topology(),
                 lambda w, new, cached: new / 100.0, random.Random(0))
    shared = list(range(1000, 1000 + 64 * 16))
    first, _ = _route(ch, [*shared, 1, 2, 3])
    second, ctx = _route(ch, [*shared, 4, 5, 6])
    assert second is not first and ctx.overlap[first.name] == 0


def test_a_failed_attempt_takes_its_provisional_prefix_away() -> None:
    clock = VirtualClock()
    ch, _ = _chooser(clock)
    shared = list(range(1000, 1000 + 64 * 16))
    first, ctx = _route(ch, [*shared, 1])
    ch.failed(ctx)
    assert ch.inflight is not None and len(ch.inflight) == 0
    first.inflight -= 1
    first.prefilling_blocks = 0
    _, ctx2 = _route(ch, [*shared, 2])
    assert all(v == 0 for v in ctx2.overlap.values())


class _Reference:
    """The tracker's contract as plain sets: (worker, block) -> live tickets that sent it."""

    def __init__(self) -> None:
        self.entries: dict[tuple[WorkerId, int], set[int]] = {}
        self.tickets: dict[int, tuple[WorkerId, list[int], float]] = {}

    def record(self, t: int, w: WorkerId, hs: list[int], expires: float) -> None:
        self.tickets[t] = (w, hs, expires)
        for h in hs:
            self.entries.setdefault((w, h), set()).add(t)

    def drop(self, t: int) -> None:
        w, hs, _ = self.tickets.pop(t, (A, [], 0.0))
        for h in hs:
            live = self.entries.get((w, h))
            if live is not None:
                live.discard(t)
                if not live:
                    del self.entries[(w, h)]

    def expire(self, now: float) -> None:
        for t in [t for t, (_, _, e) in self.tickets.items() if e <= now]:
            self.drop(t)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["record", "drop", "confirm", "leave", "look"]), st.sampled_from([A, B]),
                          st.lists(st.integers(0, 6), max_size=5), st.integers(0, 400)), max_size=40))
def test_the_tracker_answers_as_plain_sets_of_tickets_would(ops: list[tuple[str, WorkerId, list[int], int]]) -> None:
    inflight, ref = InflightPrefixes(ttl_ms=1000.0), _Reference()
    tickets: list[int] = []
    now = 0.0
    for op, w, hs, k in ops:
        now += k
        ref.expire(now)
        if op == "record":
            t = inflight.record(w, hs, now)
            ref.record(t, w, hs, now + 1000.0)
            tickets.append(t)
        elif op == "drop" and tickets:
            gone = tickets[k % len(tickets)]
            inflight.drop(gone)
            ref.drop(gone)
        elif op == "confirm":
            inflight.confirm(w, hs)
            for h in hs:
                ref.entries.pop((w, h), None)
        elif op == "leave":
            inflight.drop_worker(w)
            for left in [x for x, (tw, _, _) in ref.tickets.items() if tw == w]:
                ref.drop(left)
        probe = list(range(7))
        want = {x: next((i for i, h in enumerate(probe) if (x, h) not in ref.entries), len(probe)) for x in (A, B)}
        assert inflight.overlap(probe, [A, B], now) == want
        assert len(inflight) == len(ref.entries)
        assert all(inflight.holds(x, h) == ((x, h) in ref.entries) for x in (A, B) for h in probe)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12),
       st.lists(st.integers(0, 9), min_size=1, max_size=14))
def test_the_index_counts_leading_blocks_held_by_either_source(events: list[int], sent: list[int],
                                                               probe: list[int]) -> None:
    """A prefix whose blocks alternate between the events' set and in-flight entries, in runs of any length:
    each worker's overlap is the leading blocks held by one source or the other (``_overlap_with_inflight``)."""
    inflight = InflightPrefixes(ttl_ms=1000.0)
    idx = PrefixIndex(inflight=inflight)
    idx.apply_snapshot(A, 0, events)
    idx.apply_snapshot(B, 0, sent)
    inflight.record(A, sent, now_ms=0.0)
    inflight.record(B, events, now_ms=0.0)
    either = set(events) | set(sent)
    want = next((i for i, h in enumerate(probe) if h not in either), len(probe))
    assert idx.overlap(probe, [A, B], now_ms=1.0) == {A: want, B: want}
