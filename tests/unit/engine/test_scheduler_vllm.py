"""Conformance with vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``, 0.19): one test per rule."""

from __future__ import annotations

from actors.cost_model import StepShape, StepTime
from actors.engine.engine import Engine, EngineConfig
from actors.engine.kv_manager import KVCacheManager
from actors.engine.scheduler import Scheduler, SchedulerLimits
from actors.engine.sequence import FinishReason, RequestId, SeqStatus, Sequence
from actors.engine.virtual import ManualTime, virtual_clock


def make(blocks: int = 64, bs: int = 2, budget: int = 8, seqs: int = 8, ctx: int = 1000, **kw: object) -> Scheduler:
    return Scheduler(SchedulerLimits(seqs, budget, ctx, **kw), KVCacheManager(blocks, bs), lambda s: 7)  # type: ignore[arg-type]


def seq(rid: str, n: int, max_tokens: int = 3, at: float = 0.0, base: int = 0, priority: int = 0) -> Sequence:
    return Sequence(RequestId(rid), list(range(base + 100, base + 100 + n)), max_tokens, arrival_ms=at,
                    priority=priority)


def plan(s: Scheduler, t: float = 0.0) -> list[tuple[str, int]]:
    step = s.schedule(t)
    out: list[tuple[str, int]] = [(q.request_id, n) for q, n in step.items]
    s.complete(step, t + 1)
    return out


def test_running_requests_are_scheduled_before_waiting_ones_in_budget_order() -> None:
    s = make(budget=10)
    a, b = seq("a", 8), seq("b", 8, base=50)
    s.add(a)
    s.add(b)
    assert plan(s) == [("a", 8), ("b", 2)]  # b's prefill gets what the budget has left
    s.add(seq("c", 4, base=90))
    # Running first, in running order (a decodes, b continues its prefill), then the waiting one.
    assert plan(s, 1) == [("a", 1), ("b", 6), ("c", 3)]


def test_long_prefill_token_threshold_caps_every_chunk() -> None:
    s = make(budget=100, long_prefill_token_threshold=4)
    s.add(seq("a", 10))
    s.add(seq("b", 6, base=50))
    assert plan(s) == [("a", 4), ("b", 4)]
    assert plan(s, 1) == [("a", 4), ("b", 2)]
    assert plan(s, 2) == [("a", 2), ("b", 1)]


def test_fcfs_preempts_the_last_running_request_by_recompute() -> None:
    s = make(blocks=6, bs=2, budget=100)
    for i, rid in enumerate("abc"):
        s.add(seq(rid, 4, max_tokens=10, base=10 * i))
    assert plan(s) == [("a", 4), ("b", 4), ("c", 4)]  # 2 blocks each: the pool is full
    step = s.schedule(1)
    # a's decode needs a third block: c, last in the running list, is preempted; b then fits.
    assert [q.request_id for q in step.preempted] == ["c"]
    assert [(q.request_id, n) for q, n in step.items] == [("a", 1), ("b", 1)]
    c = step.preempted[0]
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert not s.kv.blocks_of(c.request_id)
    assert s.waiting[0] is c  # back at the head of the queue


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_last() -> None:
    s = make(blocks=4, bs=2, budget=100)
    s.add(seq("a", 4, max_tokens=10))
    s.add(seq("b", 4, max_tokens=10, base=10))
    plan(s)
    step = s.schedule(1)
    assert [q.request_id for q in step.preempted] == ["b"]
    assert [(q.request_id, n) for q, n in step.items] == [("a", 1)]


def test_no_request_is_admitted_on_a_step_that_preempted() -> None:
    s = make(blocks=5, bs=2, budget=100)
    s.add(seq("a", 4, max_tokens=10))
    s.add(seq("b", 4, max_tokens=10, base=10))
    plan(s)
    s.add(seq("tiny", 1, base=90))  # would fit in the block b's preemption frees
    step = s.schedule(1)
    assert [q.request_id for q in step.preempted] == ["b"]
    assert all(q.request_id != "tiny" for q, _ in step.items)
    assert s.waiting[0].request_id == "b"


def test_priority_policy_preempts_the_lowest_priority_and_returns_its_budget() -> None:
    s = make(blocks=6, bs=2, budget=100, policy="priority")
    s.add(seq("low", 4, max_tokens=10, priority=5))
    s.add(seq("high", 4, max_tokens=10, base=10, priority=0))
    s.add(seq("mid", 4, max_tokens=10, base=20, priority=1))
    assert [r for r, _ in plan(s)] == ["high", "mid", "low"]  # admitted by priority
    # Make the running list start with 'low', already scheduled when 'high' runs out of blocks.
    s.running.sort(key=lambda q: -q.priority)
    assert [q.request_id for q in s.running] == ["low", "mid", "high"]
    step = s.schedule(1)
    assert step.preempted[0].request_id == "low"
    assert all(q.request_id != "low" for q, _ in step.items)  # its decode left the step again
    assert step.num_tokens == sum(n for _, n in step.items)


def test_priority_queue_admits_by_priority_then_arrival() -> None:
    s = make(budget=100, seqs=1, policy="priority")
    s.add(seq("late-urgent", 2, at=5.0, priority=0))
    s.add(seq("early", 2, at=0.0, base=10, priority=1))
    s.add(seq("first-urgent", 2, at=1.0, base=20, priority=0))
    assert [q.request_id for q in s.waiting] == ["first-urgent", "late-urgent", "early"]


def test_a_preempted_request_resumes_from_its_own_blocks_freed_but_not_evicted() -> None:
    s = make(blocks=9, bs=2, budget=100)
    b = seq("b", 4, max_tokens=20, base=20)
    for q in (seq("d", 4, max_tokens=4), seq("a", 4, max_tokens=20, base=10), b):
        s.add(q)
    for t in range(3):
        plan(s, t)  # three prefills, two decodes: 3 blocks each, the pool is full
    step = s.schedule(3)
    assert [q.request_id for q in step.preempted] == ["b"]
    # b's blocks went to the free queue tail first: d and a took its two last ones, its first survives.
    s.complete(step, 4)  # d finishes: free blocks for b to resume in
    step = s.schedule(4)
    assert ("b", 7 - 2) in [(q.request_id, n) for q, n in step.items]  # 2 tokens hit, 5 recomputed
    assert b.num_computed_tokens == 2 and b.num_preemptions == 1


def test_a_finished_requests_blocks_give_prefix_hits_until_reused() -> None:
    s = make(blocks=16, bs=2, budget=100)
    s.add(seq("a", 8, max_tokens=1))
    plan(s)
    assert s.kv.pool.num_free == 16  # a finished: every block is free, still hashed
    again = seq("again", 8, max_tokens=1)
    s.add(again)
    assert plan(s, 1) == [("again", 2)]  # 3 full blocks hit; the last block is recomputed (1 token min)
    assert again.num_cached_prompt_tokens == 6


# -- async scheduling (the engine's plan/apply on virtual time) --------------------------------------------
class OneMs:
    name = "1ms"
    kv_bytes_per_token = 1
    max_context = 10_000

    def step(self, shape: StepShape) -> StepTime:
        return StepTime(1.0)


def engine(async_scheduling: bool, blocks: int = 64) -> tuple[Engine, ManualTime]:
    t = ManualTime()
    limits = SchedulerLimits(8, 64, 10_000, async_scheduling=async_scheduling)
    cfg = EngineConfig("e", "m", "colocated", blocks, 2, limits, enable_prefix_caching=False)
    return Engine(cfg, OneMs(), virtual_clock(t)), t


def run(eng: Engine, t: ManualTime, steps: int, prev_end: float | None = None) -> float | None:
    for _ in range(steps):
        step = eng.plan_step(prev_end, t.t * 1000.0)
        assert step is not None and not step.empty
        end = step.start_ms + 1.0
        t.advance_to_ms(end)
        eng.apply_step(step, StepTime(1.0), end, 0.0)
        prev_end = end
    return prev_end


def test_async_a_request_arriving_during_a_step_joins_the_step_after_next() -> None:
    for async_on, expected in ((False, 2.0), (True, 3.0)):
        eng, t = engine(async_on)
        eng.submit(list(range(100, 104)), 20, ignore_eos=True, arrival_ms=0.0)
        prev = run(eng, t, 1)  # step [0, 1): the first request's prefill
        late = eng.submit(list(range(200, 204)), 5, ignore_eos=True, arrival_ms=0.5)  # arrives mid-step
        run(eng, t, 3, prev)
        # Without async, step [1, 2) is planned at 1 and prefills it; with async that step was planned
        # at 0, before it arrived, so its prefill is step [2, 3).
        assert late.seq.first_token_ms == expected


def test_async_blocks_of_a_finished_request_are_freed_after_the_next_step_is_planned() -> None:
    eng, t = engine(True)
    s = eng.submit(list(range(100, 104)), 1, ignore_eos=True, arrival_ms=0.0)
    eng.submit(list(range(200, 210)), 10, ignore_eos=True, arrival_ms=0.0)
    prev = run(eng, t, 1)  # both prefill; the first finishes with its only token
    assert s.seq.status is SeqStatus.FINISHED
    assert eng.kv.blocks_of(s.seq.request_id)  # vLLM has not processed the step's outputs yet
    run(eng, t, 1, prev)
    assert not eng.kv.blocks_of(s.seq.request_id)


def test_async_a_request_that_stopped_on_eos_is_computed_once_more() -> None:
    eng, t = engine(True)
    stop = eng.submit(list(range(100, 104)), 50, arrival_ms=0.0)  # ends at its natural length
    stop.seq.stop_after = 2
    other = eng.submit(list(range(200, 204)), 50, ignore_eos=True, arrival_ms=0.0)
    prev = run(eng, t, 2)  # prefill (token 1), decode (token 2: EOS)
    assert stop.seq.finish_reason is FinishReason.STOP
    step = eng.plan_step(prev, t.t * 1000.0)
    assert step is not None
    assert [q.request_id for q, _ in step.items] == [stop.seq.request_id, other.seq.request_id]
    assert step.shape().decode_seqs == 2  # the wasted decode is costed
    eng.apply_step(step, StepTime(1.0), prev + 1.0, 0.0)  # type: ignore[operator]
    assert len(stop.seq.output_ids) == 2  # its extra token is discarded


def test_engine_submissions_carry_their_priority() -> None:
    t = ManualTime()
    limits = SchedulerLimits(1, 64, 10_000, policy="priority")
    eng = Engine(EngineConfig("e", "m", "colocated", 64, 2, limits), OneMs(), virtual_clock(t))
    low = eng.submit(list(range(100, 104)), 1, ignore_eos=True, arrival_ms=0.0, priority=3)
    high = eng.submit(list(range(200, 204)), 1, ignore_eos=True, arrival_ms=0.0, priority=0)
    run(eng, t, 2)
    assert high.seq.first_token_ms == 1.0 and low.seq.first_token_ms == 2.0
