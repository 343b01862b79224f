"""Hypothesis: the scheduler's invariants over random workloads, policies and async scheduling.

Every step: its tokens fit the budget; at most ``max_num_seqs`` run; each running sequence holds blocks
for every computed token; nothing is both running and waiting. At the end: every request finished with
all its tokens, and every block is back in the free queue (none leaked through preemption, async
scheduling's late frees or prefix sharing).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.kv_manager import KVCacheManager
from actors.engine.scheduler import Scheduler, SchedulerLimits
from actors.engine.sequence import FinishReason, RequestId, SeqStatus, Sequence

BS = 4
NUM_BLOCKS = 16

requests = st.lists(
    st.tuples(
        st.integers(1, 24),  # prompt tokens
        st.integers(1, 12),  # max_tokens
        st.integers(0, 6),  # arrival step
        st.integers(0, 2),  # priority
        st.sampled_from([None, 1, 3]),  # natural end (EOS) after this many tokens
        st.integers(0, 2),  # prompt family: shared prefixes
    ),
    min_size=1, max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(reqs=requests, budget=st.integers(4, 40), max_seqs=st.integers(1, 6), threshold=st.sampled_from([0, 3, 8]),
       policy=st.sampled_from(["fcfs", "priority"]), async_on=st.booleans(), caching=st.booleans())
def test_scheduler_invariants(reqs: list[tuple[int, int, int, int, int | None, int]], budget: int, max_seqs: int,
                              threshold: int, policy: str, async_on: bool, caching: bool) -> None:
    limits = SchedulerLimits(max_seqs, budget, NUM_BLOCKS * BS, long_prefill_token_threshold=threshold,
                             policy=policy, async_scheduling=async_on)  # type: ignore[arg-type]
    s = Scheduler(limits, KVCacheManager(NUM_BLOCKS, BS, caching), lambda q: 7)
    seqs = [Sequence(RequestId(f"r{i}"), [100 * fam + k for k in range(n)], m, arrival_ms=float(at),
                     priority=pri, stop_after=stop)
            for i, (n, m, at, pri, stop, fam) in enumerate(reqs)]
    pending = sorted(seqs, key=lambda q: q.arrival_ms)
    t = 0
    while pending or s.has_work():
        while pending and pending[0].arrival_ms <= t:
            s.add(pending.pop(0))
        step = s.schedule(t, t - 1 if async_on else None)
        if step.empty and async_on:
            step = s.schedule(t)
        assert step.num_tokens <= budget
        assert len(s.running) <= max_seqs
        waiting = {id(q) for q in s.waiting}
        for q in s.running:
            assert id(q) not in waiting
            assert len(s.kv.blocks_of(q.request_id)) * BS >= q.num_computed_tokens
        s.complete(step, t + 1)
        t += 1
        assert t < 5_000, "the workload did not finish"
    for q in seqs:
        assert q.status is SeqStatus.FINISHED
        if q.finish_reason is FinishReason.LENGTH:
            assert len(q.output_ids) == q.max_tokens or q.num_tokens >= limits.max_context
        else:
            assert len(q.output_ids) == q.stop_after
    assert s.kv.pool.num_free == NUM_BLOCKS
    assert not s.unfreed
