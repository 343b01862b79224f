"""Scheduler scenarios: chunked prefill, mixed steps, budget, max_num_seqs, preemption by recompute."""

from __future__ import annotations

from actors.engine.kv_manager import KVCacheManager
from actors.engine.scheduler import Scheduler, SchedulerLimits
from actors.engine.sequence import RequestId, SeqStatus, Sequence


def make(blocks: int = 64, bs: int = 2, budget: int = 8, seqs: int = 4, ctx: int = 1000) -> Scheduler:
    return Scheduler(SchedulerLimits(seqs, budget, ctx), KVCacheManager(blocks, bs), lambda s: 7)


def seq(rid: str, n: int, max_tokens: int = 3, at: float = 0.0, base: int = 0) -> Sequence:
    return Sequence(RequestId(rid), list(range(base + 100, base + 100 + n)), max_tokens, arrival_ms=at)


def run_step(s: Scheduler, t: float) -> list[tuple[str, int]]:
    step = s.schedule(t)
    plan: list[tuple[str, int]] = [(q.request_id, n) for q, n in step.items]
    s.complete(step, t + 1)
    return plan


def test_chunked_prefill_then_decodes_mixed_with_a_new_prefill() -> None:
    s = make(budget=8)
    a = seq("a", 10)
    s.add(a)
    assert run_step(s, 0) == [("a", 8)]
    assert a.output_ids == []
    shape_step = s.schedule(1)
    assert [(q.request_id, n) for q, n in shape_step.items] == [("a", 2)]
    s.complete(shape_step, 2)
    assert a.output_ids == [7] and a.first_token_ms == 2
    b = seq("b", 6, base=50)
    s.add(b)
    step = s.schedule(2)
    assert [(q.request_id, n) for q, n in step.items] == [("a", 1), ("b", 6)]
    shape = step.shape()
    assert shape.decode_seqs == 1 and shape.decode_context == 11
    assert shape.prefill_tokens == 6 and shape.prefill_seqs == 1
    s.complete(step, 3)
    assert run_step(s, 3) == [("a", 1), ("b", 1)]
    assert a.status is SeqStatus.FINISHED and len(a.output_ids) == 3
    assert s.kv.blocks_of(a.request_id) == []


def test_requests_that_have_not_arrived_wait() -> None:
    s = make()
    s.add(seq("late", 4, at=50.0))
    assert s.schedule(10.0).empty
    assert not s.schedule(50.0).empty


def test_max_num_seqs_caps_the_running_set() -> None:
    s = make(budget=100, seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", 4, base=10 * i))
    assert [r for r, _ in run_step(s, 0)] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 4 blocks of 2 tokens: two 3-token prompts take 2 blocks each; growing both needs a fifth.
    s = make(blocks=4, bs=2, budget=16, seqs=4)
    a, b = seq("a", 3, max_tokens=4), seq("b", 3, max_tokens=4, base=40)
    s.add(a)
    s.add(b)
    assert run_step(s, 0) == [("a", 3), ("b", 3)]
    assert run_step(s, 1) == [("a", 1), ("b", 1)]  # 4 tokens each still fit in 2 blocks
    step = s.schedule(2)
    assert [q.request_id for q in step.preempted] == ["b"]
    assert [(q.request_id, n) for q, n in step.items] == [("a", 1)]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and b.output_ids == [7, 7]
    s.complete(step, 3)
    t = 3.0
    while s.has_work():
        step = s.schedule(t)
        s.complete(step, t + 1)
        t += 1
        assert t < 100
    assert len(a.output_ids) == 4 and len(b.output_ids) == 4
    assert b.num_preemptions >= 1 and s.stats.preemptions >= 1
    assert s.kv.pool.num_free == 4


def test_prefix_hits_are_counted_and_skip_work() -> None:
    s = make(budget=64)
    a = seq("a", 9)
    s.add(a)
    run_step(s, 0)
    b = seq("b", 9)  # same tokens as a
    s.add(b)
    step = s.schedule(1)
    n_b = {str(q.request_id): n for q, n in step.items}["b"]
    assert n_b == 1  # 4 full blocks hit, the last token is computed
    assert s.stats.prefix_queries == 18 and s.stats.prefix_hits == 8


def test_abort_frees_blocks() -> None:
    s = make()
    a = seq("a", 6, max_tokens=50)
    s.add(a)
    run_step(s, 0)
    assert s.kv.pool.num_free < 64
    s.abort(a.request_id)
    assert s.kv.pool.num_free == 64 and a.status is SeqStatus.ABORTED
