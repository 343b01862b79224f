"""The global prefix index under lost, duplicated and reordered KV events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.router.prefix_index import ApproximateIndex, PrefixIndex
from cluster.router.view import WorkerId

A, B = WorkerId("a"), WorkerId("b")


def stored(*h: int) -> list:
    return ["stored", list(h), None]


def test_overlap_counts_leading_blocks_per_worker() -> None:
    idx = PrefixIndex()
    idx.apply_snapshot(A, 0, [1, 2, 3])
    idx.apply_snapshot(B, 0, [1, 9])
    assert idx.overlap([1, 2, 3, 4], [A, B]) == {A: 3, B: 1}
    assert idx.overlap([2, 3], [A, B]) == {A: 2, B: 0}
    assert idx.overlap([5, 1], [A, B]) == {A: 0, B: 0}  # only leading blocks count
    assert idx.overlap([], [A]) == {A: 0}


def test_events_in_order_duplicates_and_reordering() -> None:
    idx = PrefixIndex()
    idx.apply_snapshot(A, 0, [])
    assert idx.apply(A, 1, [stored(1, 2)])
    assert idx.apply(A, 1, [stored(1, 2)])  # duplicate: ignored
    assert idx.duplicates == 1
    assert idx.apply(A, 3, [["removed", [1]]])  # early: held back
    assert idx.overlap([1, 2], [A]) == {A: 2}
    assert idx.apply(A, 2, [stored(3)])  # the missing one arrives: 2 then 3 apply
    assert idx.overlap([1, 2], [A]) == {A: 0} and idx.last_seq(A) == 3
    assert idx.apply(A, 4, [["cleared"]])
    assert idx.blocks_of(A) == 0


def test_a_lost_batch_leads_to_resync_from_a_snapshot() -> None:
    idx = PrefixIndex(max_pending=2)
    idx.apply_snapshot(A, 5, [7])
    assert idx.apply(A, 7, [stored(8)])
    assert idx.apply(A, 8, [stored(9)])
    assert not idx.apply(A, 9, [stored(10)])  # 6 never came: too many waiting
    assert A in idx.needs_resync
    assert not idx.apply(A, 10, [stored(11)])  # nothing applies until the snapshot
    idx.apply_snapshot(A, 10, [7, 8, 9, 10, 11])
    assert A not in idx.needs_resync
    assert idx.overlap([7], [A]) == {A: 1}


def test_a_worker_that_leaves_is_forgotten() -> None:
    idx = PrefixIndex()
    idx.apply_snapshot(A, 0, [1, 2])
    idx.apply_snapshot(B, 0, [1])
    idx.drop_worker(A)
    assert idx.overlap([1, 2], [A, B]) == {A: 0, B: 1}
    assert idx.size() == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.booleans(), st.integers(0, 20)), min_size=1, max_size=4), max_size=30),
       st.randoms(use_true_random=False))
def test_any_delivery_order_converges_to_the_true_state(batches: list, rnd) -> None:
    """Shuffled, duplicated delivery gives the state of in-order delivery, or asks for a resync."""
    truth: set[int] = set()
    numbered = []
    for i, batch in enumerate(batches, start=1):
        evs = []
        for add, h in batch:
            evs.append(stored(h) if add else ["removed", [h]])
            (truth.add if add else truth.discard)(h)
        numbered.append((i, evs))
    delivered = numbered + [rnd.choice(numbered) for _ in range(len(numbered) // 3)] if numbered else []
    rnd.shuffle(delivered)
    idx = PrefixIndex(max_pending=1000)
    idx.apply_snapshot(A, 0, [])
    for seq, evs in delivered:
        assert idx.apply(A, seq, evs)
    assert idx.last_seq(A) == len(numbered)
    assert {h for h in range(21) if idx.overlap([h], [A])[A]} == truth


def test_approximate_index_forgets_after_its_ttl() -> None:
    idx = ApproximateIndex(ttl_ms=100)
    idx.record(A, [1, 2, 3], now_ms=0)
    assert idx.overlap([1, 2, 4], [A, B], now_ms=50) == {A: 2, B: 0}
    assert idx.overlap([1, 2], [A], now_ms=150) == {A: 0}
    idx.expire(150)
    assert not idx._seen


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stored", "removed", "snapshot", "cleared", "leave"]),
                          st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 5), max_size=6)), max_size=40),
       st.lists(st.integers(0, 5), max_size=6))
def test_overlaps_are_those_of_each_workers_own_block_set(ops: list[tuple[str, str, list[int]]],
                                                          probe: list[int]) -> None:
    # Blocks held by one worker, by several, by none, as events come and go: every answer is the one each
    # worker's own set of blocks gives (the index keeps a block's holders as one name or a set).
    idx, truth = PrefixIndex(), {w: set[int]() for w in "abc"}
    for w in "abc":
        idx.apply_snapshot(WorkerId(w), 0, [])
    for op, w, hs in ops:
        worker = WorkerId(w)
        if op == "snapshot":
            idx.apply_snapshot(worker, idx.last_seq(worker) or 0, hs)
            truth[w] = set(hs)
        elif op == "leave":
            idx.drop_worker(worker)
            idx.apply_snapshot(worker, 0, [])
            truth[w] = set()
        else:
            assert idx.apply(worker, (idx.last_seq(worker) or 0) + 1, [[op, hs, None] if op != "cleared" else [op]])
            truth[w] = truth[w] | set(hs) if op == "stored" else truth[w] - set(hs) if op == "removed" else set()
        workers = [WorkerId(x) for x in "abc"]

        def depth(x: str) -> int:
            return next((i for i, h in enumerate(probe) if h not in truth[x]), len(probe))
        assert idx.overlap(probe, workers) == {WorkerId(x): depth(x) for x in "abc"}
        assert all(idx.held_depth(WorkerId(x), probe) == depth(x) for x in "abc")
        assert all(idx.hashes_of(WorkerId(x)) == truth[x] for x in "abc")
        assert idx.size() == len(set().union(*truth.values()))
