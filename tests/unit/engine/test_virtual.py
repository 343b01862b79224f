"""The virtual-clock driver: the real engine's steps, with time jumping to each step's end."""

from __future__ import annotations

import pytest

from actors.cost_model import StepShape, StepTime
from actors.engine.engine import EngineConfig
from actors.engine.scheduler import SchedulerLimits
from actors.engine.virtual import ClosedLoop, ManualTime, RequestRecord, VirtualDriver, virtual_clock


class Fixed:
    """1 ms per step plus 0.01 ms per prefill token."""

    name = "fixed"
    kv_bytes_per_token = 1
    max_context = 100_000

    def step(self, shape: StepShape) -> StepTime:
        return StepTime(1.0 + 0.01 * shape.prefill_tokens)


def driver(blocks: int = 1000, seqs: int = 64, budget: int = 4096) -> VirtualDriver:
    cfg = EngineConfig("v", "m", "colocated", blocks, 16, SchedulerLimits(seqs, budget, 100_000),
                       enable_prefix_caching=False)
    return VirtualDriver(cfg, Fixed())


def test_manual_time_drives_the_clock_forward_only() -> None:
    t = ManualTime()
    c = virtual_clock(t)
    t.advance_to_ms(12.5)
    assert c.now_ms() == pytest.approx(12.5)
    t.advance_to_ms(3.0)
    assert c.now_ms() == pytest.approx(12.5)


def test_one_client_sees_the_cost_models_timeline_exactly() -> None:
    res = driver().run(ClosedLoop(1, 2, input_len=100, output_len=5))
    first, second = res.records
    # Prefill step 1 + 100 x 0.01 = 2 ms emits token 1; four 1 ms decode steps follow.
    assert first.ttft_ms == pytest.approx(2.0) and first.tpot_ms == pytest.approx(1.0)
    assert first.output_tokens == 5 and first.e2e_ms == pytest.approx(6.0)
    # The client's next request goes out when the previous one's last token arrived.
    assert second.arrival_ms == pytest.approx(first.last_token_ms)
    assert res.steps == 10 and res.end_ms == pytest.approx(12.0)


def test_closed_loop_keeps_concurrency_clients_busy() -> None:
    res = driver().run(ClosedLoop(4, 12, input_len=32, output_len=8))
    assert [r.index for r in res.records] == list(range(12))
    assert all(r.output_tokens == 8 for r in res.records)
    # The first four go out together; their prefills share one step (budget 4096).
    assert {r.arrival_ms for r in res.records[:4]} == {0.0}
    assert len({r.first_token_ms for r in res.records[:4]}) == 1


def test_a_request_outgrowing_the_cache_ends_early_instead_of_hanging() -> None:
    # 8 blocks of 16 hold 128 tokens: the prompt fits, the output cannot all fit: the engine ends it (length).
    res = driver(blocks=8, budget=64).run(ClosedLoop(1, 1, input_len=100, output_len=100))
    (rec,) = res.records
    assert 1 <= rec.output_tokens < 100


def test_ttft_splits_into_queue_wait_and_prefill() -> None:
    # Budget 100: the burst's four 100-token prompts are prefilled one per step (2 ms each), so the k-th
    # waits k steps before it is first scheduled; each one's own prefill takes one step.
    res = driver(budget=100).run(ClosedLoop(4, 4, input_len=100, output_len=2))
    assert [r.queue_ms for r in res.records] == pytest.approx([0.0, 2.0, 4.0, 6.0], abs=1.5)
    for r in res.records:
        assert r.queue_ms + r.prefill_ms == pytest.approx(r.ttft_ms)
        assert r.arrival_ms <= r.first_scheduled_ms < r.first_token_ms


def test_enough_stops_sending_and_lets_requests_in_flight_finish() -> None:
    seen: list[int] = []

    def enough(done: list[RequestRecord]) -> bool:
        seen.append(len(done))
        return len(done) >= 3

    res = driver().run(ClosedLoop(2, 100, input_len=32, output_len=4), enough)
    # Two go out at once; each finish sends the next until three have finished; the one then in flight
    # still finishes.
    assert 3 <= len(res.records) <= 4 and all(r.output_tokens == 4 for r in res.records)
    assert seen and seen[-1] >= 3


def test_a_burst_gap_lets_the_idle_engine_start_with_the_first_request_alone() -> None:
    together = driver().run(ClosedLoop(3, 3, input_len=32, output_len=4))
    spread = driver().run(ClosedLoop(3, 3, input_len=32, output_len=4, burst_gap_ms=0.1))
    assert len({r.first_token_ms for r in together.records}) == 1  # one shared prefill step
    first, *rest = spread.records
    assert first.first_scheduled_ms == 0.0
    assert [r.arrival_ms for r in spread.records] == pytest.approx([0.0, 0.1, 0.2])
    assert all(r.first_token_ms > first.first_token_ms for r in rest)
    with pytest.raises(ValueError):
        ClosedLoop(1, 1, 1, 1, burst_gap_ms=-1.0)


def caching_driver(blocks: int = 1000) -> VirtualDriver:
    cfg = EngineConfig("v", "m", "colocated", blocks, 16, SchedulerLimits(64, 4096, 100_000),
                       enable_prefix_caching=True)
    return VirtualDriver(cfg, Fixed())


def test_warm_up_runs_first_unrecorded_and_the_measured_burst_waits_for_its_last_request() -> None:
    d = driver()
    res = d.run(ClosedLoop(2, 4, input_len=32, output_len=3, warmup_requests=3))
    assert [r.index for r in res.records] == [0, 1, 2, 3]  # the three warm-up requests are not records
    # The warm-up's third request ran alone after the first two: the measured phase opens when it ended,
    # with both clients at once.
    first, second = res.records[:2]
    assert first.arrival_ms == second.arrival_ms > 0.0
    assert d.engine.scheduler.stats.prompt_tokens == 7 * 32


def test_prompts_drawn_from_a_pool_repeat_as_the_seeded_draws_say_and_hit_the_cache() -> None:
    import random

    load = ClosedLoop(1, 6, input_len=64, output_len=2, warmup_requests=2, prompt_pool=3, pool_seed=7)
    draw = load.prompt_indices()
    rng = random.Random(7)
    expected = [rng.choice(range(3)) for _ in range(8)]
    assert [draw() for _ in range(8)] == expected  # aiperf's DatasetManager: Random(seed).choice per request
    d = caching_driver()
    res = d.run(load)
    stats = d.engine.scheduler.stats
    repeats = sum(1 for i, p in enumerate(expected) if p in expected[:i])
    assert repeats > 0
    # A repeated 64-token prompt hits its first 3 blocks (the last token is always computed).
    assert stats.prefix_hits == repeats * 48
    fresh = driver().run(ClosedLoop(1, 6, input_len=64, output_len=2, warmup_requests=2))
    assert sum(r.ttft_ms for r in res.records) < sum(r.ttft_ms for r in fresh.records)
    with pytest.raises(ValueError):
        ClosedLoop(1, 1, 1, 1, prompt_pool=-1)


@pytest.mark.parametrize(("async_", "steps_after"), [(True, 2), (False, 1)])
def test_a_clients_turnaround_moves_its_next_request_past_the_next_planned_step(async_: bool,
                                                                              steps_after: int) -> None:
    # Two clients out of phase: one decodes (1 ms steps) while the other's next request comes in. With
    # async scheduling vLLM planned the step after the token's one already, so a request that arrives any
    # time after the token joins the step after that (the second); without, the next one.
    def run(turnaround: float) -> RequestRecord:
        cfg = EngineConfig("v", "m", "colocated", 1000, 16, SchedulerLimits(64, 4096, 100_000, async_scheduling=async_),
                           enable_prefix_caching=False)
        load = ClosedLoop(2, 4, input_len=32, output_len=6, burst_gap_ms=0.5, turnaround_ms=turnaround)
        return VirtualDriver(cfg, Fixed()).run(load).records[2]

    at_once, later = run(0.0), run(0.3)
    assert later.arrival_ms == pytest.approx(at_once.arrival_ms + 0.3)  # the token's step ended at at_once's
    token_step_end = at_once.arrival_ms
    assert at_once.first_scheduled_ms == pytest.approx(token_step_end + (steps_after - 1) * 1.0)
    assert later.first_scheduled_ms == pytest.approx(token_step_end + steps_after * 1.0)
    with pytest.raises(ValueError):
        ClosedLoop(1, 1, 1, 1, turnaround_ms=-1.0)
